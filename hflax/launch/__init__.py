"""Launch: `python -m hflax.launch --config ppo.py` (the main job) and the plan CLI."""
