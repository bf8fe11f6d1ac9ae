"""The functions every layer calls with the same shapes, traced once per model call.

A model call runs its layers in a Python loop, so JAX traces each layer's attention,
matmuls, RoPE and norms once per layer: 30 times for SmolLM2, in every program that runs
the model (prefill, decode step, forward, update). Inside `one_trace_per_call()` (the
model's __call__ opens it) a function marked `traced_once` is jitted once for the whole
call, so the 30 layers share one trace and one lowering; XLA inlines the calls, and
SmolLM2's programs came out with the same fusions and bit-equal results, and a first
step's tracing, lowering and compiling all take less time.

The jit (of a new function object: JAX keys its trace cache by function) lives only as long
as the call: the next call traces afresh, so tuning constants and monkeypatched helpers
(tests, benches) take effect as they did without it. Outside a model call, and in a call
that is not being traced (eager: op by op, where a jit per call would compile every
time), a marked function is called as it is.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import jax

_scopes = threading.local()


@contextlib.contextmanager
def one_trace_per_call(x):
  """Within it, each `traced_once` function is jitted once (a fresh jit per scope), if the
  call is being traced (x, an array it computes with, is a tracer); else a no-op."""
  if not isinstance(x, jax.core.Tracer):
    yield
    return
  stack = _scopes.__dict__.setdefault("stack", [])
  stack.append({})
  try:
    yield
  finally:
    stack.pop()


def traced_once(**jit_kwargs):
  """Decorator: inside one_trace_per_call, call the function through a jit made for that
  scope (jit_kwargs: its static arguments); outside, call it directly."""
  def wrap(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
      stack = _scopes.__dict__.get("stack")
      if not stack:
        return fn(*args, **kwargs)
      jitted = stack[-1].get(fn)
      if jitted is None:  # JAX caches traces by function: a new one for every scope
        fresh = functools.wraps(fn)(lambda *a, **k: fn(*a, **k))
        jitted = stack[-1][fn] = jax.jit(fresh, **jit_kwargs)
      return jitted(*args, **kwargs)
    return call
  return wrap
