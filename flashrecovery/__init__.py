"""flashrecovery: keep PyTorch training jobs running through rank failures."""
