"""Where a traced program casts float32 arrays to bfloat16, from its jaxpr."""
import jax
import jax.numpy as jnp


def bfloat16_casts(jaxpr, shapes) -> tuple[int, int]:
  """(outside, inside a scan or while loop): convert_element_type equations turning a
  float32 array shaped as one of `shapes` into bfloat16, in jaxpr and the jaxprs nested
  in it."""
  found = [0, 0]

  def walk(jaxpr, inside):
    for eqn in jaxpr.eqns:
      src = eqn.invars[0].aval if eqn.invars else None
      if (eqn.primitive.name == "convert_element_type" and
          eqn.params["new_dtype"] == jnp.bfloat16 and
          getattr(src, "shape", None) in shapes and src.dtype == jnp.float32):
        found[inside] += 1
      loop = eqn.primitive.name in ("scan", "while")
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub, inside or loop)

  walk(jaxpr, False)
  return found[0], found[1]
