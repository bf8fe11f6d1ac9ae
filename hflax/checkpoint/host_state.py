"""Host state in a checkpoint's JSON item: plain values plus tagged arrays, PRNG keys,
tuples and NamedTuples, each restored as the type it was."""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

TAGS = ("__array__", "__key__", "__tuple__", "__namedtuple__")


def encode(x, path="host_state"):
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  if isinstance(x, dict):
    for k in x:
      if not isinstance(k, str) or k in TAGS:
        raise TypeError(f"{path}: key {k!r} cannot be stored (keys are strings, not {TAGS})")
    return {k: encode(v, f"{path}[{k!r}]") for k, v in x.items()}
  if isinstance(x, tuple) and hasattr(x, "_fields"):
    cls = type(x)
    return {"__namedtuple__": f"{cls.__module__}:{cls.__qualname__}",
            "fields": {f: encode(getattr(x, f), f"{path}.{f}") for f in x._fields}}
  if isinstance(x, (list, tuple)):
    items = [encode(v, f"{path}[{i}]") for i, v in enumerate(x)]
    return items if isinstance(x, list) else {"__tuple__": items}
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      # Typed keys cannot be copied to the host as such; their raw data plus the impl can.
      return {"__key__": str(jax.random.key_impl(x)),
              "data": np.asarray(jax.random.key_data(x)).tolist()}
    # tolist() is exact: every float dtype widens to a Python float and narrows back.
    a = np.asarray(x)
    return {"__array__": a.dtype.name, "shape": list(a.shape), "data": a.tolist(),
            "jax": isinstance(x, jax.Array)}
  raise TypeError(f"{path}: {type(x).__name__} is not storable host state")


def decode(x):
  if isinstance(x, list):
    return [decode(v) for v in x]
  if not isinstance(x, dict):
    return x
  if "__key__" in x:
    return jax.random.wrap_key_data(jnp.asarray(x["data"], jnp.uint32), impl=x["__key__"])
  if "__array__" in x:
    a = np.asarray(x["data"], dtype=jnp.dtype(x["__array__"])).reshape(x["shape"])
    return jnp.asarray(a) if x["jax"] else a
  if "__tuple__" in x:
    return tuple(decode(v) for v in x["__tuple__"])
  if "__namedtuple__" in x:
    module, qualname = x["__namedtuple__"].split(":")
    cls = importlib.import_module(module)
    for part in qualname.split("."):
      cls = getattr(cls, part)
    return cls(**{k: decode(v) for k, v in x["fields"].items()})
  return {k: decode(v) for k, v in x.items()}
