"""Test doubles for the engine's users: a scripted world without torch that plays the agent and
the ranks as records (simworld.py), for tests, the benches and the scripted example."""
