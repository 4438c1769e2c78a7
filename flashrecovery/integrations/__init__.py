"""flashrecovery inside other trainers: each module adapts one (it imports that trainer, so it
is imported only by a script that uses it)."""
