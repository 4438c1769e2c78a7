"""``python -m flashrecovery.integrations.torchtitan`` (what `flashrecovery run -m` starts)."""

from flashrecovery.integrations.torchtitan import main

main()
