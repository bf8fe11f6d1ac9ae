"""The config files `python -m hflax.launch --config NAME` resolves NAME to (shipped inside
the package, so a regular install runs them too). Each defines get_config() -> ConfigDict."""
