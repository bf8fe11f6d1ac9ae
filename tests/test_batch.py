"""Batch, hflax's DataProto."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.controller.batch import Batch


def _batch():
  return Batch.from_dict({"ids": jnp.arange(12).reshape(4, 3), "score": np.arange(4.0),
                          "answer": ["a", "b", "c", "d"]}, meta={"step": 1})


def test_fields_and_validation():
  b = _batch()
  assert len(b) == 4 and sorted(b.keys()) == ["answer", "ids", "score"]
  assert b.objects["answer"].dtype == object
  with pytest.raises(ValueError, match="disagree on the batch size"):
    Batch({"a": jnp.zeros(3), "b": jnp.zeros(4)})
  with pytest.raises(KeyError, match="no field 'nope'"):
    b["nope"]


def test_union_merges_and_rejects_conflicts():
  b = _batch()
  u = b.select(["ids"]).union(Batch({"extra": jnp.ones(4)}, meta={"metrics": {"a": 1}}))
  assert sorted(u.keys()) == ["extra", "ids"]
  u2 = u.union(Batch(meta={"metrics": {"b": 2}}))
  assert u2.meta["metrics"] == {"a": 1, "b": 2}
  assert b.union(b.select(["ids"])).keys() == b.keys()  # the same values are no conflict
  with pytest.raises(ValueError, match="field 'ids' differs"):
    b.union(Batch({"ids": jnp.zeros((4, 3), jnp.int32)}))
  with pytest.raises(ValueError, match="meta 'step' differs"):
    b.union(Batch({"x": jnp.zeros(4)}, meta={"step": 2}))


def test_repeat_reorder_chunk_concat_pad():
  b = _batch()
  r = b.repeat(2)
  np.testing.assert_array_equal(np.asarray(r["ids"])[:, 0], [0, 0, 3, 3, 6, 6, 9, 9])
  assert list(r["answer"]) == ["a", "a", "b", "b", "c", "c", "d", "d"]
  t = b.repeat(2, interleave=False)
  assert list(t["answer"]) == ["a", "b", "c", "d"] * 2
  p = b.reorder([3, 1, 0, 2])
  np.testing.assert_array_equal(p["score"], [3.0, 1.0, 0.0, 2.0])
  assert list(p["answer"]) == ["d", "b", "a", "c"]
  parts = b.chunk(2)
  assert [len(c) for c in parts] == [2, 2]
  back = Batch.concat(parts)
  np.testing.assert_array_equal(np.asarray(back["ids"]), np.asarray(b["ids"]))
  with pytest.raises(ValueError, match="4 rows into 3"):
    b.chunk(3)
  padded, pad = b.pad_to_divisor(3)
  assert (len(padded), pad) == (6, 2)
  assert list(padded["answer"]) == ["a", "b", "c", "d", "a", "b"]
  assert list(padded.unpad(pad)["answer"]) == list(b["answer"])


def test_arrays_stay_on_their_devices():
  devices = jax.devices()
  b = Batch({"x": jax.device_put(jnp.arange(8.0), devices[5])})
  r = b.repeat(2).reorder(np.arange(16)[::-1]).select(["x"])
  assert r["x"].devices() == {devices[5]}
  mesh = jax.sharding.Mesh(np.array(devices[:4]), ("data",))
  placed = b.place(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  assert len(placed["x"].addressable_shards) == 4
  assert isinstance(b.to_host()["x"], np.ndarray)
