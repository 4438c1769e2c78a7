"""A tokenizer and a text dataset for torchtitan's debug model where torchtitan's repository
is not at hand (its wheel does not ship the tests/assets its debug configs name):

    python -m flashrecovery.integrations.torchtitan.assets DIR

writes ``DIR/tokenizer`` (for ``--hf_assets_path``) and ``DIR/c4_test`` (for
``--dataloader.dataset_path``): a byte-level BPE tokenizer trained on generated documents, and
those documents as C4's test set lays them out, the same bytes on every run.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "the", "rank", "step", "spare", "replica", "shard", "mesh", "pipeline", "tensor", "recover",
    "commit", "vote", "log", "engine", "model", "gradient", "optimizer", "batch", "token",
    "generation", "donor", "group", "barrier", "checkpoint",
)  # fmt: skip
DOCUMENTS = 400


def write(directory: Path) -> tuple[Path, Path]:
    """The tokenizer's and the dataset's directories, written under ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    draw = random.Random(0)
    documents = [
        " ".join(draw.choice(WORDS) for _ in range(draw.randint(20, 80))) for _ in range(DOCUMENTS)
    ]
    dataset = directory / "c4_test"
    dataset.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({"text": document}) for document in documents)
    (dataset / "documents.json").write_text("\n".join(lines) + "\n")

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    assets = directory / "tokenizer"
    assets.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(assets / "tokenizer.json"))
    config = {"bos_token": special[1], "eos_token": special[2], "add_bos_token": True}
    (assets / "tokenizer_config.json").write_text(json.dumps(config))
    return assets, dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    assets, dataset = write(parser.parse_args().directory)
    print(f"--hf_assets_path {assets} --dataloader.dataset_path {dataset}")


if __name__ == "__main__":
    main()
