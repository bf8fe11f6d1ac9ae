"""The config files `python -m hflax.launch --config NAME` resolves NAME to (shipped inside
the package, so a regular install runs them too). Each defines get_config() -> ConfigDict."""


def packing_defaults(c):
  """Packed passes on (verl's use_remove_padding=True): the same losses and gradients as
  the padded passes, and not slower even on grpo.py's short rows (the update and the
  log-prob pass alike; the shorter the prompts, the more packing saves). Token-budget
  micro-batches (use_dynamic_bsz) stay off."""
  c.model.use_remove_padding = True
  return c
