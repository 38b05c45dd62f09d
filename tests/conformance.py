"""Conformance bases (no tests of their own): one suite every Source runs, one every Sink runs.

As zarr's ``StoreTests`` (zarr/testing/store.py): a format's test class subclasses a
base and provides one fixture; the base's tests check the protocol, so a new format
starts with the whole suite.

* :class:`SourceTests`: the subclass's ``written`` fixture writes a checkpoint with the
  format's REAL library (xckpt's Writer, torch DCP, orbax, safetensors, torch.save)
  from :data:`TRUTH` (the arrays its format can hold) and :data:`OBJECTS` (where it
  has objects); the base checks the read protocol of :class:`xckpt.source.Source`
  against that truth, bit for bit.
* :class:`SinkTests`: the base writes one xckpt source of all of :data:`TRUTH` and
  :data:`OBJECTS` (two writers), converts it with ``xckpt.convert`` to the subclass's
  format, and the subclass's :meth:`SinkTests.read_back` reads the output with the
  format's own library; the base compares bit for bit, reads it back through
  ``xckpt.open``, and drives the sink through its call protocol
  (:class:`xckpt.sink.Sink`).

Arrays are small and every checkpoint is written once per class: the whole suite
stays well under a minute on two cores.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
import pytest

import xckpt
from xckpt.errors import (
    CheckpointExistsError,
    DtypeMismatchError,
    MissingEntryError,
    ShapeMismatchError,
    XckptError,
)
from xckpt.formats import FORMATS, detect
from xckpt.layout import Box
from xckpt.manifest import dtype_name
from xckpt.sink import WriteJob


def _truth() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(22)

    def normal(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return rng.standard_normal(shape).astype(dtype)

    return {
        "model.w": normal((6, 8), np.float32),
        "model.b": normal((8,), np.float64),
        "model.bf16": normal((4, 6), ml_dtypes.bfloat16),
        "model.f16": normal((5,), np.float16),
        "model.f8_e4m3": normal((4, 4), ml_dtypes.float8_e4m3fn),
        "model.f8_e5m2": normal((3, 5), ml_dtypes.float8_e5m2),
        "model.ids": rng.integers(-(2**40), 2**40, (7,), dtype=np.int64),
        "model.i32": rng.integers(-(2**30), 2**30, (2, 3), dtype=np.int32),
        "model.u8": rng.integers(0, 256, (9,), dtype=np.uint8),
        "model.mask": rng.integers(0, 2, (5,)).astype(bool),
        "model.scalar": np.asarray(3.5, dtype=np.float32),
        "model.empty": np.zeros((0, 4), np.float32),
        "model.multi": normal((16, 8), np.float32),
    }


#: name -> array: every dtype a format may hold (bfloat16, float8 included), a 0-d
#: tensor, an empty one, and ``model.multi``, stored as several chunks where the
#: format allows.
TRUTH: dict[str, np.ndarray] = _truth()
#: Objects, where a format has them.
OBJECTS: dict[str, Any] = {"step": 7, "cfg": {"lr": 0.5, "name": "run"}}
MULTI = "model.multi"
#: Rows of ``model.multi`` per writer, where a test writes it in pieces.
MULTI_ROWS = ((0, 5), (5, 16))


def bits(a: Any) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def same(got: Any, want: np.ndarray) -> bool:
    """Same dtype, shape and bytes (bit for bit, NaN payloads included)."""
    got = np.asarray(got)
    return got.dtype == want.dtype and got.shape == want.shape and bits(got) == bits(want)


def torch_to_numpy(t: Any) -> np.ndarray:
    """A torch tensor as numpy, bit for bit (bfloat16 and float8 through ml_dtypes)."""
    import torch

    t = t.detach().contiguous()
    special = {
        torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
        torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
        torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
    }
    if t.dtype in special:
        via, npd = special[t.dtype]
        return t.view(via).numpy().view(npd)
    return t.numpy()


def numpy_to_torch(a: np.ndarray) -> Any:
    """A numpy array as a torch tensor, bit for bit (bfloat16 and float8 by a same-width view)."""
    import torch

    special = {
        np.dtype(ml_dtypes.bfloat16): (np.int16, torch.bfloat16),
        np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn),
        np.dtype(ml_dtypes.float8_e5m2): (np.uint8, torch.float8_e5m2),
    }
    a = np.array(a, order="C")  # not ascontiguousarray: it makes a 0-d array 1-d
    if a.dtype in special:
        via, tdt = special[a.dtype]
        return torch.from_numpy(a.view(via).copy()).view(tdt)
    return torch.from_numpy(a.copy())


def write_xckpt(path: str, arrays: dict[str, np.ndarray], objects: dict[str, Any]) -> str:
    """An xckpt checkpoint written by two :class:`xckpt.Writer` ranks in this process:
    ``model.multi`` split by rows over both, everything else on rank 0."""
    for rank, (lo, hi) in enumerate(MULTI_ROWS):
        w = xckpt.Writer(path, rank=rank, world_size=len(MULTI_ROWS), save_id="conformance", progress=False)
        for name, a in arrays.items():
            w.declare(name, a.dtype, a.shape)
            if name == MULTI:
                w.write(name, a[lo:hi], global_shape=a.shape, offset=(lo, 0))
            elif rank == 0:
                w.write(name, a, global_shape=a.shape, offset=(0,) * a.ndim)
        if rank == 0:
            for k, v in objects.items():
                w.write_object(k, v)
        w.commit()
    xckpt.finalize(path, len(MULTI_ROWS), "conformance")
    return path


def _tiles(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """The boxes lie inside ``shape``, are disjoint and cover it."""
    whole = Box.full(shape)
    if not all(whole.contains(b) for b in boxes):
        return False
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            common = a.intersect(b)
            if common is not None and common.volume:
                return False
    return sum(b.volume for b in boxes) == whole.volume


def _box_list(t: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return sorted((tuple(c.offset), tuple(c.shape)) for c in t.chunks if c.box.volume)


def _boxes_of(shape: tuple[int, ...]) -> dict[str, tuple[Any, ...]]:
    """Index expressions per kind of box: a slice, a single element, an empty box."""
    if not shape:
        return {"element": ()}  # a 0-d tensor's one element
    if 0 in shape:
        return {"slice": (slice(0, 0),), "empty": (slice(0, 0), *(slice(1, 1) for _ in shape[1:]))}
    first = tuple(0 for _ in shape)
    last = tuple(n - 1 for n in shape)
    return {
        "slice": (slice(shape[0] // 3, shape[0]),) + tuple(slice(n // 2, n) for n in shape[1:]),
        "element": last if len(shape) % 2 else first,
        "empty": (slice(1, 1),) + (slice(None),) * (len(shape) - 1),
    }


def _mark_known(request: pytest.FixtureRequest, known: dict[str, str]) -> None:
    why = known.get(request.node.name)
    if why is not None:
        request.applymarker(pytest.mark.xfail(reason=why, strict=True))


@dataclass(frozen=True)
class Written:
    """A checkpoint a :class:`SourceTests` subclass wrote with its format's own library."""

    path: str
    #: The truth it holds: the arrays of :data:`TRUTH` its format can hold.
    arrays: dict[str, np.ndarray]
    #: The objects, as ``objects()`` must return them.
    objects: dict[str, Any] = field(default_factory=dict)
    #: Options for ``xckpt.open`` (``allow_pickle`` for DCP's pickled objects).
    options: dict[str, Any] = field(default_factory=dict)


class SourceTests:
    """The read protocol, on a checkpoint written by the format's own library.

    A subclass sets :attr:`format` and provides a class-scoped ``written`` fixture
    returning :class:`Written`; :attr:`not_held` names what of :data:`TRUTH` its
    format cannot hold, and why (those cases are skipped, saying so).
    """

    format: ClassVar[str]
    #: Names of :data:`TRUTH` the format cannot hold -> why.
    not_held: ClassVar[dict[str, str]] = {}
    #: Whether the format stores ``model.multi`` as several chunks.
    multi_chunk: ClassVar[bool] = True
    #: Test ids (``test_read_box[model.w-slice]``) that fail for a known bug -> the bug. They
    #: run as strict xfails: a fix makes them pass, and then the entry must go.
    known_failures: ClassVar[dict[str, str]] = {}

    @pytest.fixture(autouse=True)
    def _known_failure(self, request: pytest.FixtureRequest) -> None:
        _mark_known(request, self.known_failures)

    @pytest.fixture
    def src(self, written: Written) -> Any:
        with xckpt.open(written.path, **written.options) as s:
            yield s

    def _truth(self, written: Written, name: str) -> np.ndarray:
        if name not in written.arrays:
            pytest.skip(f"{self.format} cannot hold {name}: {self.not_held.get(name, 'not written')}")
        return written.arrays[name]

    # -- identity -----------------------------------------------------------------------------

    def test_format_is_detected(self, written: Written) -> None:
        assert detect(written.path) == self.format
        with xckpt.open(written.path, **written.options) as s:
            assert s.format == self.format
        with xckpt.open(written.path, format=self.format, **written.options) as s:
            assert s.format == self.format

    def test_nothing_unread_and_unnoted(self, written: Written) -> None:
        """Every conformance checkpoint is read whole: opening warns nothing and the source notes
        nothing it left unread (`metadata["notes"]`, where a format keeps them)."""
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with xckpt.open(written.path, **written.options) as s:
                assert list(s.metadata.get("notes", [])) == []

    def test_names(self, src: Any, written: Written) -> None:
        assert sorted(src.names()) == sorted(written.arrays)
        assert all(n in src for n in written.arrays) and "no.such.tensor" not in src

    @pytest.mark.parametrize("name", list(TRUTH))
    def test_info(self, src: Any, written: Written, name: str) -> None:
        want = self._truth(written, name)
        t = src.info(name)
        assert t.dtype == dtype_name(want.dtype) and t.np_dtype == want.dtype
        assert tuple(t.shape) == want.shape and t.nbytes == want.nbytes
        assert _tiles(tuple(t.shape), [c.box for c in t.chunks]), [c.box for c in t.chunks]

    def test_multi_chunk_tensor(self, src: Any) -> None:
        if not self.multi_chunk:
            pytest.skip(f"{self.format} stores every tensor whole")
        assert len([c for c in src.info(MULTI).chunks if c.box.volume]) > 1

    # -- tensors ------------------------------------------------------------------------------

    @pytest.mark.parametrize("name", list(TRUTH))
    def test_read_whole(self, src: Any, written: Written, name: str) -> None:
        want = self._truth(written, name)
        assert same(src.read(name), want)

    @pytest.mark.parametrize("kind", ["slice", "element", "empty"])
    @pytest.mark.parametrize("name", list(TRUTH))
    def test_read_box(self, src: Any, written: Written, name: str, kind: str) -> None:
        want = self._truth(written, name)
        index = _boxes_of(want.shape).get(kind)
        if index is None:
            pytest.skip(f"no {kind} box in shape {want.shape}")
        box = xckpt.layout.box_from_index(want.shape, index)
        assert same(src.read(name, index), np.array(want[box.slices()], order="C"))

    def test_read_into_several_at_once(self, src: Any, written: Written) -> None:
        items = []
        for name, want in written.arrays.items():
            for index in _boxes_of(want.shape).values():
                box = xckpt.layout.box_from_index(want.shape, index)
                items.append((name, box, np.empty(box.shape, want.dtype), want[box.slices()]))
        src.read_into([(n, b, out) for n, b, out, _ in items], show_progress=False)
        bad = [(n, b) for n, b, out, want in items if not same(out, np.array(want, order="C"))]
        assert bad == []

    def test_read_all(self, src: Any, written: Written) -> None:
        got = src.read_all(show_progress=False)
        assert sorted(got) == sorted(written.arrays)
        assert [n for n, want in written.arrays.items() if not same(got[n], want)] == []

    def test_read_units_cover_the_box(self, src: Any, written: Written) -> None:
        for name in written.arrays:
            t = src.info(name)
            for c in t.chunks:
                boxes = [c.box]
                if c.box.volume and len(c.shape) and c.shape[0] > 1:
                    boxes.append(Box(c.offset, (1, *c.shape[1:])))  # the chunk's first row
                for box in boxes:
                    units = src.read_units(name, c, box, t.np_dtype.itemsize)
                    assert sum(units.values()) >= box.volume * t.np_dtype.itemsize, (name, box, units)

    def test_verify(self, src: Any) -> None:
        assert src.verify(show_progress=False) == []

    # -- objects ------------------------------------------------------------------------------

    def test_objects(self, src: Any, written: Written) -> None:
        assert sorted(src.object_names()) == sorted(written.objects)
        assert src.objects() == written.objects
        if written.objects:
            name = sorted(written.objects)[0]
            assert src.objects([name]) == {name: written.objects[name]}

    # -- errors -------------------------------------------------------------------------------

    def test_missing_tensor_names_it(self, src: Any) -> None:
        with pytest.raises(MissingEntryError, match=r"no\.such\.tensor"):
            src.info("no.such.tensor")
        with pytest.raises(MissingEntryError, match=r"no\.such\.tensor"):
            src.read("no.such.tensor")

    def test_wrong_dtype_out(self, src: Any, written: Written) -> None:
        want = written.arrays["model.w"]
        out = np.empty(want.shape, np.int8)
        with pytest.raises(DtypeMismatchError, match=r"model\.w"):
            src.read_into([("model.w", Box.full(want.shape), out)], show_progress=False)

    def test_wrong_shape_out(self, src: Any, written: Written) -> None:
        want = written.arrays["model.w"]
        out = np.empty((want.shape[0] + 1, want.shape[1]), want.dtype)
        with pytest.raises(ShapeMismatchError, match=r"model\.w"):
            src.read_into([("model.w", Box.full(want.shape), out)], show_progress=False)
        outside = Box((want.shape[0] - 1, 0), (2, want.shape[1]))
        with pytest.raises(ShapeMismatchError, match=r"model\.w"):
            src.read_into([("model.w", outside, np.empty(outside.shape, want.dtype))], show_progress=False)

    # -- lifetime and views -------------------------------------------------------------------

    def test_context_manager_closes_once_or_twice(self, written: Written) -> None:
        calls: list[str] = []
        with xckpt.open(written.path, **written.options) as s:
            real = s.close
            s.close = lambda: (calls.append("close"), real())[1]  # type: ignore[method-assign]
            assert same(s.read("model.w"), written.arrays["model.w"])
        assert calls == ["close"]
        s.close()  # idempotent
        real()

    def test_repr_and_notebook_view(self, src: Any, written: Written) -> None:
        r = repr(src)
        assert self.format in r and f"{len(written.arrays)} tensors" in r
        bundle = src._repr_mimebundle_()
        assert set(bundle) >= {"text/plain", "text/html"}
        assert "model.w" in bundle["text/plain"] and "model.w" in bundle["text/html"]


@dataclass
class Converted:
    """A :class:`SinkTests` conversion: the output path and what its own library read back."""

    path: str
    arrays: dict[str, np.ndarray]
    objects: dict[str, Any]


class SinkTests:
    """The write protocol: every sink's output read back by the format's own library.

    A subclass sets :attr:`format` and :attr:`dst` (the output's name; its suffix may
    choose the format) and implements :meth:`read_back`; :attr:`objects` says how the
    objects come back through the format's library.
    """

    format: ClassVar[str]
    #: Output name (a file name for file formats).
    dst: ClassVar[str]
    #: Extra ``xckpt.convert`` options.
    options: ClassVar[dict[str, Any]] = {}
    #: The objects as the format's own library returns them (``None``: :data:`OBJECTS`).
    objects: ClassVar[dict[str, Any] | None] = None
    #: The objects as ``xckpt.open`` of the output returns them (``None``: :data:`OBJECTS`).
    xckpt_objects: ClassVar[dict[str, Any] | None] = None
    #: Whether the output keeps the source writers' boxes.
    keeps_layout: ClassVar[bool] = False
    #: As :attr:`SourceTests.known_failures`.
    known_failures: ClassVar[dict[str, str]] = {}

    @pytest.fixture(autouse=True)
    def _known_failure(self, request: pytest.FixtureRequest) -> None:
        _mark_known(request, self.known_failures)

    def read_back(self, path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Tensors (numpy, bit for bit) and objects of ``path``, read by the format's library."""
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def source(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        return write_xckpt(str(tmp_path_factory.mktemp("sink-src") / "src"), TRUTH, OBJECTS)

    @pytest.fixture(scope="class")
    @classmethod
    def converted(cls, source: str, tmp_path_factory: pytest.TempPathFactory) -> Converted:
        dst = str(tmp_path_factory.mktemp("sink-out") / cls.dst)
        assert xckpt.convert(source, dst, to_format=cls.format, show_progress=False, **cls.options) == dst
        arrays, objects = cls().read_back(dst)
        return Converted(dst, arrays, objects)

    def _job(self, src: Any, dst: str, bar: Any) -> WriteJob:
        names = tuple(src.names())
        return WriteJob(src, dst, names, src.objects(), self.options.get("max_shard_size"), bar)

    # -- read back by the format's own library ------------------------------------------------

    @pytest.mark.parametrize("name", list(TRUTH))
    def test_library_reads_back(self, converted: Converted, name: str) -> None:
        assert same(converted.arrays[name], TRUTH[name])

    def test_library_reads_every_tensor(self, converted: Converted) -> None:
        assert sorted(converted.arrays) == sorted(TRUTH)

    def test_library_reads_objects(self, converted: Converted) -> None:
        assert converted.objects == (OBJECTS if self.objects is None else self.objects)

    # -- read back through xckpt --------------------------------------------------------------

    def test_xckpt_open_reads_back(self, converted: Converted, source: str) -> None:
        with xckpt.open(converted.path, allow_pickle=True) as out, xckpt.open(source) as src:
            assert out.format == self.format and detect(converted.path) == self.format
            got = out.read_all(show_progress=False)
            assert sorted(got) == sorted(TRUTH)
            assert [n for n, want in TRUTH.items() if not same(got[n], want)] == []
            want_objects = OBJECTS if self.xckpt_objects is None else self.xckpt_objects
            assert out.objects() == want_objects
            assert out.verify(show_progress=False) == []
            if self.keeps_layout:
                for n in TRUTH:
                    assert _box_list(out.info(n)) == _box_list(src.info(n)), n

    # -- the destination ----------------------------------------------------------------------

    def test_existing_destination_needs_overwrite(self, source: str, tmp_path: Any) -> None:
        dst = str(tmp_path / self.dst)
        xckpt.convert(source, dst, to_format=self.format, show_progress=False, **self.options)
        with pytest.raises(CheckpointExistsError, match="already exists; pass overwrite=True"):
            xckpt.convert(source, dst, to_format=self.format, show_progress=False, **self.options)
        assert self.read_back(dst)[0].keys() == TRUTH.keys()  # the first output is untouched
        xckpt.convert(source, dst, to_format=self.format, overwrite=True, show_progress=False, **self.options)
        assert sorted(os.listdir(tmp_path)) == [self.dst]  # no temporary or old output left behind

    # -- the call protocol, driven directly ----------------------------------------------------

    def test_call_protocol(self, source: str, tmp_path: Any) -> None:
        sink = FORMATS[self.format].sink
        assert sink.format == self.format
        landed: list[int] = []
        bar = type("Bar", (), {"update": lambda _self, n=1: landed.append(n)})()
        dst = str(tmp_path / self.dst)
        with xckpt.open(source) as src:
            job = self._job(src, dst, bar)
            sink.check(job)  # step 2: nothing written, no tensor bytes read
            assert not os.path.lexists(dst) and landed == [] and dict(job.crcs) == {}
            sink.write(job)  # step 3
            assert os.path.lexists(dst)
            assert sum(landed) == sum(src.info(n).nbytes for n in job.names)
            # Tensor bytes came through the job: every stored box has the source's crc32c.
            boxes = {(n, tuple(c.offset), tuple(c.shape)) for n in job.names for c in src.info(n).chunks if c.box.volume}
            assert boxes <= set(job.crcs)
        with xckpt.open(dst, format=self.format, allow_pickle=True) as out:
            assert sorted(out.names()) == sorted(TRUTH)

    def test_interrupted_write_is_never_taken_for_complete(self, source: str, tmp_path: Any) -> None:
        # A write stopped at each progress update in turn (the exception unwinds through the sink's
        # own cleanup: files closed and flushed, more than a killed process leaves) leaves what the
        # format's reader refuses, or the whole checkpoint (stopped after its last byte).
        class Stop(BaseException):
            pass

        sink = FORMATS[self.format].sink
        partial = []
        for k in range(1, 100):
            dst = str(tmp_path / str(k) / self.dst)
            os.makedirs(os.path.dirname(dst))
            updates = [0]

            def update(_self: Any, n: int = 1, k: int = k, updates: list[int] = updates) -> None:
                updates[0] += 1
                if updates[0] == k:
                    raise Stop

            with xckpt.open(source) as src:
                job = self._job(src, dst, type("Bar", (), {"update": update})())
                sink.check(job)
                try:
                    sink.write(job)
                    break  # fewer than k updates: every stop point was tried
                except Stop:
                    pass
            try:
                with xckpt.open(dst, format=self.format, allow_pickle=True) as out:
                    got = out.read_all(show_progress=False)
            except XckptError:
                continue  # refused, as it must be
            if sorted(got) != sorted(TRUTH) or any(not same(got[n], want) for n, want in TRUTH.items()):
                partial.append(f"stopped at update {k}: taken for a checkpoint of {sorted(got)}")
        assert k > 3 and partial == []

    def test_interrupted_conversion_leaves_nothing(
        self, source: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        class Bar:
            landed = 0

            def __enter__(self) -> Bar:
                return self

            def __exit__(self, *exc: object) -> None:
                pass

            def update(self, n: int = 1) -> None:
                Bar.landed += 1
                if Bar.landed == 3:
                    raise KeyboardInterrupt

        monkeypatch.setattr(sys.modules["xckpt.convert"], "progress", lambda *a, **k: Bar())
        with pytest.raises(KeyboardInterrupt):
            xckpt.convert(source, str(tmp_path / self.dst), to_format=self.format, **self.options)
        assert os.listdir(tmp_path) == []

    def test_object_it_cannot_hold_is_never_lost_silently(self, source: str, tmp_path: Any) -> None:
        # A function no format holds: check refuses it (naming it, nothing written) or warns
        # that it is dropped (naming it).
        dst = str(tmp_path / self.dst)
        with xckpt.open(source) as src, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            job = WriteJob(src, dst, ("model.w",), {"odd": lambda: 0}, self.options.get("max_shard_size"), _NoBar())
            try:
                FORMATS[self.format].sink.check(job)
                refused = None
            except XckptError as e:
                refused = str(e)
        if refused is None:
            assert any("'odd'" in str(w.message) for w in caught), [str(w.message) for w in caught]
        else:
            assert "'odd'" in refused
        assert not os.path.lexists(dst)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``a.b`` -> ``{"a": {"b": ...}}``."""
    tree: dict[str, Any] = {}
    for k, v in flat.items():
        node = tree
        *head, last = k.split(".")
        for h in head:
            node = node.setdefault(h, {})
        node[last] = v
    return tree


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": v}}`` -> ``{"a.b": v}`` (dict leaves only)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def json_objects(metadata: dict[str, str]) -> dict[str, Any]:
    """Objects as the safetensors sink stores them: JSON text in ``__metadata__``."""
    return {k: json.loads(v) for k, v in metadata.items() if k in OBJECTS}
