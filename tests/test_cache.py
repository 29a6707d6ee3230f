"""The caches: the in-memory method cache and the two disk levels (by AST: the key of the compiled
bytes, no rendering on a hit; by rendered source: the compiled bytes), plus the UOp-graph and
LaunchInfo serializers."""
from __future__ import annotations

import itertools
import json
import re
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from morok_py import UOp, dtypes
from morok_py import cache
from morok_py.cache import DiskCache, disk_key, stats

from conftest import ROOT


_TAGS = itertools.count(1000 + uuid.uuid4().int % 10**6)


def fresh_tag(frac: float = 0.5) -> float:
    """A constant no earlier test of this process used (a counter, not a random draw: two draws from
    a small range collided once in CI and the second test found its kernel in the memory cache)."""
    return float(next(_TAGS)) + frac


def unique_kernel(tag: float | None = None) -> UOp:
    """out[i] = x[i] * c with a constant no other test uses, so no cache has seen it."""
    c = tag if tag is not None else fresh_tag()
    x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)
    i = UOp.range(UOp.variable("n", 1, 1 << 20), 0)
    return UOp.sink(out.store(i, x.load(i) * c))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("MOROK_CACHE_DIR", str(d))
    monkeypatch.delenv("MOROK_CACHE", raising=False)
    return d


def entry_paths(cpu, ast, name=None) -> tuple[Path, Path, str]:
    """The source-level entry (compiled bytes)."""
    renderer, compiler = cpu.pair()
    key = disk_key(compiler, renderer.render(ast, name))
    root = Path(os.environ["MOROK_CACHE_DIR"])
    return root / key[:2] / f"{key}.bin", root / key[:2] / f"{key}.json", key


def ast_entry_paths(cpu, ast, name=None) -> tuple[Path, Path, str]:
    """The AST-level entry (launch information and the source-level key)."""
    from morok_py.device import kernel_name
    renderer, compiler = cpu.pair()
    key = cache.ast_key(renderer, compiler, ast, kernel_name(ast, name))
    root = Path(os.environ["MOROK_CACHE_DIR"])
    return root / key[:2] / f"{key}.bin", root / key[:2] / f"{key}.json", key


def run_times_two(cpu, prog, rng):
    x = rng.standard_normal(7).astype(np.float32)
    out = cpu.empty(7, dtypes.float32)
    prog(cpu.buf(x), out, n=7)
    return x, out.numpy()


def test_second_compile_is_a_method_cache_hit(cpu, cache_dir):
    ast = unique_kernel()
    before = (stats.compiles, stats.method_hits)
    p1 = cpu.compile(ast)
    p2 = cpu.compile(ast)
    assert p2 is p1
    assert (stats.compiles - before[0], stats.method_hits - before[1]) == (1, 1)


def test_different_kernel_names_are_different_entries(cpu, cache_dir):
    ast = unique_kernel()
    assert cpu.compile(ast, "first") is not cpu.compile(ast, "second")


def test_memory_cleared_compile_hits_the_disk_cache(cpu, cache_dir, rng):
    ast = unique_kernel(3.25)
    cpu.compile(ast)
    cache.clear_memory_caches()
    before = (stats.compiles, stats.disk_hits)
    prog = cpu.compile(ast)
    assert (stats.compiles - before[0], stats.disk_hits - before[1]) == (0, 1)
    x, got = run_times_two(cpu, prog, rng)
    np.testing.assert_allclose(got, x * np.float32(3.25))


def test_a_second_process_hits_the_disk_cache(cpu, cache_dir):
    tag = fresh_tag()
    cpu.compile(unique_kernel(tag))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import numpy as np\n"
        "from morok_py import Device, Buffer, UOp, dtypes\n"
        "from morok_py.cache import stats\n"
        "x, out = UOp.param(0, dtypes.float32), UOp.param(1, dtypes.float32)\n"
        "i = UOp.range(UOp.variable('n', 1, 1 << 20), 0)\n"
        "ast = UOp.sink(out.store(i, x.load(i) * float(sys.argv[2])))\n"
        "dev = Device['CPU']\n"
        "prog = dev.compile(ast)\n"
        "out = dev.buffer(3, dtypes.float32)\n"
        "prog(Buffer.from_numpy(np.array([1, 2, 3], np.float32), dev), out, n=3)\n"
        "print(stats.compiles, stats.disk_hits, *out.numpy())\n")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT), repr(tag)], capture_output=True, text=True,
                         env=dict(os.environ), check=True)
    compiles, disk_hits, *vals = res.stdout.split()
    assert (int(compiles), int(disk_hits)) == (0, 1)
    np.testing.assert_allclose([float(v) for v in vals], np.array([1, 2, 3], np.float32) * np.float32(tag))


def test_disk_entry_is_raw_bytes_plus_json_not_pickle(cpu, cache_dir):
    ast = unique_kernel()
    cpu.compile(ast)
    bin_path, meta_path, key = entry_paths(cpu, ast)
    renderer, compiler = cpu.pair()
    assert bin_path.read_bytes() == compiler.compile(renderer.render(ast)).bytes   # deterministic object bytes
    meta = json.loads(meta_path.read_text())
    assert meta["key"] == key and meta["size"] == bin_path.stat().st_size and meta["compiler"] == "llvm"
    assert {p.suffix for p in bin_path.parent.iterdir()} == {".bin", ".json"}


def test_cache_dir_is_private(cpu, cache_dir):
    cpu.compile(unique_kernel())
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700


def test_disk_key_is_deterministic_and_depends_on_source(cpu):
    renderer, compiler = cpu.pair()
    a, b = unique_kernel(1.5), unique_kernel(2.5)
    assert disk_key(compiler, renderer.render(a)) == disk_key(compiler, renderer.render(a))
    assert disk_key(compiler, renderer.render(a)) != disk_key(compiler, renderer.render(b))


def test_disk_key_includes_toolchain_version(cpu):
    import llvmlite
    _, compiler = cpu.pair()
    assert llvmlite.__version__ in compiler.identity()


def compiled_entry(cpu, base: float, paths):
    """A kernel no cache has seen, compiled through the caches: (ast, its constant, and the entry's
    .bin path, .json path, key and bytes) for the entry `paths` names."""
    tag = fresh_tag(base % 1)
    ast = unique_kernel(tag)
    cpu.compile(ast)
    bin_path, meta_path, key = paths(cpu, ast)
    return ast, tag, bin_path, meta_path, key, bin_path.read_bytes()


@pytest.mark.parametrize("damage", ["flip a byte of .bin", "garbage .json", "truncate .bin"])
def test_corrupt_source_entry_is_recompiled_and_rewritten(cpu, cache_dir, rng, damage):
    ast, tag, bin_path, meta_path, key, good = compiled_entry(cpu, 100.5, entry_paths)
    if damage.startswith("flip"):
        data = bytearray(good)
        data[len(data) // 2] ^= 0xFF
        bin_path.write_bytes(bytes(data))
    elif damage.startswith("garbage"):
        meta_path.write_text("{not json")
    else:
        bin_path.write_bytes(good[:100])
    cache.clear_memory_caches()
    before = (stats.compiles, stats.disk_corrupt, stats.disk_hits)
    prog = cpu.compile(ast)
    assert (stats.compiles - before[0], stats.disk_corrupt - before[1], stats.disk_hits - before[2]) == (1, 1, 0)
    assert bin_path.read_bytes() == good                    # rewritten
    assert DiskCache().get(key) is not None                 # and valid again
    x, got = run_times_two(cpu, prog, rng)
    np.testing.assert_allclose(got, x * np.float32(tag))


def test_morok_cache_0_writes_nothing(cpu, cache_dir, monkeypatch):
    monkeypatch.setenv("MOROK_CACHE", "0")
    ast = unique_kernel()
    cpu.compile(ast)
    cache.clear_memory_caches()
    before = stats.compiles
    cpu.compile(ast)
    assert stats.compiles - before == 1        # no disk hit either
    assert not cache_dir.exists() or not any(cache_dir.rglob("*"))


def test_unwritable_cache_dir_still_compiles(cpu, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MOROK_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match="compiling without the disk cache"):
        assert cpu.compile(unique_kernel()) is not None
    assert blocker.read_text() == "not a directory"      # nothing outside the cache folder is touched


def test_disk_cache_rejects_non_digest_keys(tmp_path):
    with pytest.raises(ValueError, match="sha256"):
        DiskCache(tmp_path).get("../../etc/passwd")


def test_a_recreated_device_gets_its_own_programs(clean_registry, rng):
    from morok_py import Device, register_backend
    from morok_py.backends.cpu.device import CPUDevice
    register_backend("RECREATED", CPUDevice)
    old = Device["RECREATED"]
    ast = unique_kernel(5.5)
    assert old.compile(ast).device is old
    register_backend("RECREATED", CPUDevice)       # replaces the backend and drops the opened device
    new = Device["RECREATED"]
    assert new is not old
    prog = new.compile(ast)
    assert prog.device is new
    x = rng.standard_normal(7).astype(np.float32)
    out = new.buffer(7, dtypes.float32)
    prog(new.buffer(7, dtypes.float32).copyin(x), out, n=7)
    np.testing.assert_allclose(out.numpy(), x * np.float32(5.5))


# ---- the UOp graph serializer ----------------------------------------------------------------------

def every_op_graph() -> list[UOp]:
    """Nodes of every op, with every kind of arg the IR uses (and a few it could)."""
    from morok_py import AxisType, Ops
    f32, i32 = dtypes.float32, dtypes.int32
    n = UOp.variable("n", 1, 1 << 20)
    x, out = UOp.param(0, f32), UOp.param(1, f32)
    i = UOp.range(n, 0)
    k = UOp.range(n, 1, AxisType.REDUCE)
    j = UOp.range(UOp.const(7), 2, AxisType.LOOP)
    a = x.load(i)
    consts = [UOp.const(v, f32) for v in (float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1.5e-300 * 1e-10,
                                          0.1)]
    consts += [UOp.const(True), UOp.const(False), UOp.const(-(1 << 63), dtypes.int64),
               UOp.const((1 << 64) - 1, dtypes.uint64)]
    nodes = [UOp(op, f32, (a, a), None) for op in (Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.MAX, Ops.MIN)]
    nodes += [UOp(op, dtypes.bool, (a, a), None) for op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE)]
    nodes += [UOp(op, i32, (i, i), None) for op in (Ops.IDIV, Ops.MOD, Ops.CDIV, Ops.CMOD, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL,
                                                  Ops.SHR)]
    nodes += [UOp(op, f32, (a,), None) for op in (Ops.NEG, Ops.EXP2, Ops.LOG2, Ops.SQRT, Ops.SIN, Ops.RECIP,
                                                  Ops.TRUNC)]
    nodes += [UOp(Ops.NOT, i32, (i,), None), UOp(Ops.CAST, dtypes.float16, (a,), None),
              UOp(Ops.BITCAST, i32, (a,), None), UOp(Ops.WHERE, f32, (consts[7], a, consts[0]), None),
              x.load(k).reduce(k, op=Ops.MAX), (a * 2.0).reduce(k), x.load(j),
              # arg types no builder makes, but a UOp may carry: a dtype, an op, nested tuples, strings
              UOp(Ops.CAST, f32, (a,), dtypes.bfloat16), UOp(Ops.NEG, f32, (a,), (Ops.ADD, ("s", (1, 2.5), None)))]
    stores = [out.store(i, a), out.store(0, nodes[0]), out.store(1, consts[2])]
    roots = [UOp.sink(*stores), *consts, *nodes]
    assert {u.op for r in roots for u in r.toposort()} == set(Ops), "a new op: give it a node here"
    return roots


def named_asts() -> dict[str, UOp]:
    from morok_py import kernels as K
    return {name: build() for name, build in K.NAMED.items()}


def test_uop_graphs_round_trip_to_the_same_hash_consed_nodes():
    from morok_py.ir import uops_from_json, uops_to_json
    roots = every_op_graph() + list(named_asts().values())
    d = json.loads(json.dumps(uops_to_json(roots), allow_nan=False))      # plain JSON, no NaN literals
    back = uops_from_json(d)
    assert all(b is r for b, r in zip(back, roots)) and len(back) == len(roots)
    assert [b.key for b in back] == [r.key for r in roots]


def test_shared_nodes_are_stored_once():
    from morok_py.ir import uops_to_json
    ast = named_asts()["softmax"]
    d = uops_to_json([ast, ast, ast.src[0]])
    assert d["nodes"] == uops_to_json([ast])["nodes"] and d["roots"][0] == d["roots"][1]


def test_uop_graphs_rebuilt_in_a_fresh_process_have_the_same_keys(tmp_path):
    """Not a hash-consing hit: the nodes are built anew and must still get the same keys."""
    from morok_py.ir import uops_to_json
    roots = every_op_graph() + list(named_asts().values())
    (tmp_path / "g.json").write_text(json.dumps(uops_to_json(roots)))
    code = ("import json, sys; sys.path.insert(0, sys.argv[1])\n"
            "from morok_py.ir import uops_from_json\n"
            "print(json.dumps([u.key for u in uops_from_json(json.load(open(sys.argv[2])))]))\n")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT), str(tmp_path / "g.json")], capture_output=True,
                         text=True, check=True)
    assert json.loads(res.stdout) == [r.key for r in roots]


def _table():
    from morok_py.ir import uops_to_json
    d = uops_to_json([UOp.param(0, dtypes.float32).load(UOp.const(3))])
    assert d["nodes"] == ["PARAM", "float32", 0, 0, "CONST", "int32", 0, 3, "LOAD", "float32", 2, 0, 1, None]
    return d


@pytest.mark.parametrize("damage", [
    lambda d: d.update(format="morok-uops-1"),
    lambda d: d["nodes"].__setitem__(0, "FROBNICATE"),                 # unknown op
    lambda d: d["nodes"].__setitem__(1, "float7"),                     # unknown dtype
    lambda d: d["nodes"].__setitem__(11, 2),                           # a source that is not built yet
    lambda d: d["nodes"].__setitem__(11, -1),                          # negative index
    lambda d: d["nodes"].__setitem__(10, 3),                           # more sources than there are
    lambda d: d["nodes"].__setitem__(10, "2"),
    lambda d: d["nodes"].__setitem__(3, {"float": "1.0"}),             # unknown arg tag
    lambda d: d["nodes"].__setitem__(3, 1.5),                          # an untagged float
    lambda d: d["nodes"].pop(),                                        # cut short
    lambda d: d["nodes"].append("ADD"),
    lambda d: d.update(nodes={"0": "PARAM"}),
    lambda d: d.update(roots=[3]),
], ids=["format", "op", "dtype", "forward-src", "negative-src", "src-count", "src-count-type", "arg-tag",
        "bare-float", "cut-short", "trailing", "not-a-list", "root"])
def test_malformed_uop_tables_are_value_errors(damage):
    from morok_py.ir import uops_from_json
    d = _table()
    assert uops_from_json(json.loads(json.dumps(d)))[0].op.name == "LOAD"
    damage(d)
    with pytest.raises(ValueError):
        uops_from_json(d)


def test_unserializable_args_are_refused_when_writing():
    from morok_py import Ops
    from morok_py.ir import uops_to_json
    with pytest.raises(TypeError, match="no JSON form"):
        uops_to_json([UOp(Ops.CONST, dtypes.float32, (), np.float64(1.5))])   # a float subclass: another node


# ---- LaunchInfo round trips ------------------------------------------------------------------------

def renderers():
    """(id, renderer) for every renderer this machine can build without a GPU."""
    from morok_py import Device
    out = [("CPU", Device["CPU"].renderer)]
    try:
        from morok_py.backends.cuda import compile_only_pairs as cuda_pairs
        out += [(f"CUDA-{c.cache_key}", r) for r, c in cuda_pairs("sm_90")]
    except ImportError:
        pass
    try:
        from morok_py.backends.rocm import compile_only_pairs as rocm_pairs
        out += [(f"ROCM-{c.cache_key}-{arch}", r) for arch in ("gfx942", "gfx1100") for r, c in rocm_pairs(arch)]
    except ImportError:
        pass
    return out


def assert_same_launch(a, b):
    """Attribute by attribute, UOps by identity (UOp's == builds a comparison node)."""
    from morok_py.codegen import launch_io
    assert set(vars(a)) == set(vars(b))
    for attr in ("params", "variables", "var_names", "local_size", "gpu", "grid_max", "group_per_item",
                 "hidden", "buf_count", "symbolic"):
        assert getattr(a, attr) == getattr(b, attr), attr
    for attr in ("dims", "range_ends"):
        assert len(getattr(a, attr)) == len(getattr(b, attr))
        assert all(x is y for x, y in zip(getattr(a, attr), getattr(b, attr))), attr
    assert len(a.accesses) == len(b.accesses)
    for x, y in zip(a.accesses, b.accesses):
        assert (x.slot, x.store, len(x.enclosing)) == (y.slot, y.store, len(y.enclosing))
        assert x.index is y.index and all(r is q for r, q in zip(x.enclosing, y.enclosing))
    assert launch_io.dump(a) == launch_io.dump(b)


def variable_values(info) -> list[dict]:
    """A few value sets: every variable at its minimum, small odd sizes, larger ones, its maximum."""
    sets = []
    for pick in (lambda v: v.min, lambda v: min(v.max, max(v.min, 7)), lambda v: min(v.max, max(v.min, 61)),
                 lambda v: min(v.max, max(v.min, 1001)), lambda v: v.max):
        sets.append({v.name: pick(v) for v in info.variables})
    return sets


def launch_results(info, values):
    """launch_dims and prepare (sizes, bounds, work) for these values, or the error they raise."""
    try:
        return ("ok", info.launch_dims(values), info.prepare(info.values_from(values)))
    except Exception as e:   # an overflow is a LaunchError: it must be the same one after the round trip
        return ("error", type(e).__name__, str(e))


@pytest.mark.parametrize("rid,renderer", renderers(), ids=[r[0] for r in renderers()])
def test_launch_info_round_trips_for_every_named_kernel(rid, renderer):
    from morok_py.codegen import launch_io
    for name, ast in named_asts().items():
        info = renderer.render(ast, name).launch
        assert not launch_io.unknown_attributes(info), (
            f"LaunchInfo has attributes launch_io does not store: {launch_io.unknown_attributes(info)}; "
            f"teach codegen/launch_io.py (and bump its FORMAT)")
        back = launch_io.load(json.loads(json.dumps(launch_io.dump(info), allow_nan=False)))
        assert_same_launch(info, back)
        for values in variable_values(info):
            assert launch_results(back, values) == launch_results(info, values), (name, values)


def test_launch_io_refuses_a_launch_info_with_unknown_attributes(cpu):
    from morok_py.codegen import launch_io
    info = cpu.dev.renderer.render(unique_kernel(), "k").launch
    info.new_thing = 1
    with pytest.raises(launch_io.LaunchIOError, match="new_thing"):
        launch_io.dump(info)


def test_launch_info_with_hidden_buffers_round_trips(cpu):
    from morok_py.codegen import launch_io
    from morok_py.codegen.lower import HiddenBuffer, LaunchInfo
    info = cpu.dev.renderer.render(named_asts()["sum"], "s").launch
    hidden = LaunchInfo(info.params, info.variables, info.dims, info.local_size, True, info.accesses,
                        info.range_ends, info.grid_max, group_per_item=True,
                        hidden=(HiddenBuffer(dtypes.float32, 1024), HiddenBuffer(dtypes.uint32, 1)))
    assert_same_launch(hidden, launch_io.load(json.loads(json.dumps(launch_io.dump(hidden)))))


@pytest.mark.parametrize("damage", [
    lambda d: d.update(format="morok-launch-0"),
    lambda d: d.pop("hidden"),
    lambda d: d.update(extra=1),
    lambda d: d.update(local_size=[1, 1]),
    lambda d: d.update(gpu=1),
    lambda d: d["params"][0].__setitem__(1, "float7"),
    lambda d: d.update(dims=[10**6]),
    lambda d: d.update(dims=[-1]),
    lambda d: d["uops"]["nodes"].__setitem__(0, "FROBNICATE"),
], ids=["format", "missing", "extra", "short-size", "int-bool", "dtype", "ref", "negative-ref", "op"])
def test_malformed_launch_records_are_launch_io_errors(cpu, damage):
    from morok_py.codegen import launch_io
    d = launch_io.dump(cpu.dev.renderer.render(unique_kernel(), "k").launch)
    damage(d)
    with pytest.raises(launch_io.LaunchIOError):
        launch_io.load(d)


# ---- the AST level of the disk cache ----------------------------------------------------------------

def test_a_disk_hit_by_ast_does_not_render(cpu, cache_dir, rng, monkeypatch):
    ast = unique_kernel(fresh_tag(0.25))
    first = cpu.compile(ast)
    cache.clear_memory_caches()
    render = type(cpu.dev.renderer).render
    monkeypatch.setattr(type(cpu.dev.renderer), "render", lambda *a, **k: pytest.fail("rendered on a hit"))
    before = (stats.compiles, stats.renders, stats.ast_hits, stats.disk_hits)
    prog = cpu.compile(ast)
    assert (stats.compiles - before[0], stats.renders - before[1], stats.ast_hits - before[2],
            stats.disk_hits - before[3]) == (0, 0, 1, 1)
    assert prog is not first
    monkeypatch.setattr(type(cpu.dev.renderer), "render", render)
    x, got = run_times_two(cpu, prog, rng)
    tag = ast.src[0].src[2].src[1].arg
    np.testing.assert_allclose(got, x * np.float32(tag))


def test_a_hit_gives_the_compiled_spec_a_cold_compile_gives(cpu, cache_dir):
    import dataclasses
    from morok_py.device import CompiledSpec
    # every field is stored (or rebuilt): a new one must be taught to cache._ast_entry / _from_ast_entry
    assert [f.name for f in dataclasses.fields(CompiledSpec)] == [
        "name", "src", "bytes", "ast", "var_names", "global_size", "local_size", "buf_count", "launch", "arch",
        "compiler", "param_dtypes"]
    for name, ast in named_asts().items():
        cold = cpu.compile(ast, name).compiled
        cache.clear_memory_caches()
        before = stats.ast_hits
        hit = cpu.compile(ast, name).compiled
        assert stats.ast_hits == before + 1, name
        assert hit == cold      # every field but launch (compare=False)
        assert hit.ast is ast
        assert_same_launch(hit.launch, cold.launch)


FRESH_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from morok_py import Buffer, Device, kernels as K
from morok_py.cache import stats
dev = Device["CPU"]
M, N, Kd = 37, 53, 29
rng = np.random.default_rng(7)
a, b = rng.standard_normal((M, Kd)).astype(np.float32), rng.standard_normal((Kd, N)).astype(np.float32)
prog = dev.compile(K.named("matmul"), name="fresh_mm")
out = dev.buffer(M * N, "float32")
prog(Buffer.from_numpy(a.ravel(), dev), Buffer.from_numpy(b.ravel(), dev), out, M=M, N=N, K=Kd)
np.save(sys.argv[2], out.numpy().reshape(M, N))
print(json.dumps({"compiles": stats.compiles, "renders": stats.renders, "ast_hits": stats.ast_hits,
                  "disk_hits": stats.disk_hits, "disk_corrupt": stats.disk_corrupt}))
"""


def populate_then_run_child(populate, pairs, *args: str) -> tuple[dict, object]:
    """Fill the disk cache in this process, then run a child that should hit it: the child's last line
    of output as JSON, and what `populate` returned. The AST-level key covers the code's files (path,
    size, mtime), so a file saved in between (someone editing the tree) is a legitimate miss: then
    it tries again."""
    for _ in range(3):
        cache._code_fingerprints.clear()       # the code as it is on disk now, as the child sees it
        before = [cache.code_fingerprint(r, c) for r, c in pairs]
        made = populate()
        res = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True,
                             env=dict(os.environ, MOROK_DEBUG="1"), check=True)
        cache._code_fingerprints.clear()
        if [cache.code_fingerprint(r, c) for r, c in pairs] == before:
            return json.loads(res.stdout.strip().splitlines()[-1]) | {"log": res.stderr}, made
    pytest.skip("the source tree kept changing under the test")


def test_a_fresh_process_hit_does_no_compile_and_no_render(cpu, cache_dir, tmp_path):
    from morok_py import kernels as K
    counts, _ = populate_then_run_child(lambda: cpu.compile(K.named("matmul"), "fresh_mm"), [cpu.pair()],
                                        FRESH_CHILD, str(ROOT), str(tmp_path / "out.npy"))
    log = counts.pop("log")
    assert counts == {"compiles": 0, "renders": 0, "ast_hits": 1, "disk_hits": 1, "disk_corrupt": 0}, log
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((37, 29)).astype(np.float32), rng.standard_normal((29, 53)).astype(np.float32)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), a @ b, rtol=1e-4, atol=1e-4)


def _store_with_checksum(bin_path: Path, meta_path: Path, data: bytes) -> None:
    """Replace an entry's bytes and fix up its checksum: an entry that is intact but unusable."""
    import hashlib
    bin_path.write_bytes(data)
    meta = json.loads(meta_path.read_text())
    meta.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    meta_path.write_text(json.dumps(meta))


def _rewrite_payload(bin_path: Path, meta_path: Path, edit) -> None:
    entry = json.loads(bin_path.read_bytes())
    edit(entry)
    _store_with_checksum(bin_path, meta_path, json.dumps(entry).encode())


AST_DAMAGE = {
    "truncate": lambda b, m: b.write_bytes(b.read_bytes()[:40]),
    "flip a byte": lambda b, m: b.write_bytes(bytes([b.read_bytes()[0] ^ 0x20]) + b.read_bytes()[1:]),
    "garbage meta": lambda b, m: m.write_text("{not json"),
    "not json (checksum fixed)": lambda b, m: _store_with_checksum(b, m, b"\x00{]"),
    "wrong entry version": lambda b, m: _rewrite_payload(b, m, lambda e: e.update(format="morok-ast-entry-0")),
    "a launch record beside it": lambda b, m: _rewrite_payload(b, m, lambda e: e.update(launch={"accesses": []})),
    "another kernel's AST": lambda b, m: _rewrite_payload(b, m, lambda e: e.update(ast="0" * 64)),
    "another kernel's name": lambda b, m: _rewrite_payload(b, m, lambda e: e.update(name="k_other")),
    "emptied source key": lambda b, m: _rewrite_payload(b, m, lambda e: e.update(source_key="")),
    "bad source key": lambda b, m: _rewrite_payload(b, m, lambda e: e.update(source_key="../../etc/passwd")),
}


@pytest.mark.parametrize("damage", list(AST_DAMAGE))
def test_a_corrupt_or_incompatible_ast_entry_is_a_counted_miss_that_is_rewritten(cpu, cache_dir, rng, damage):
    ast, tag, bin_path, meta_path, key, good = compiled_entry(cpu, 300.5, ast_entry_paths)
    AST_DAMAGE[damage](bin_path, meta_path)
    cache.clear_memory_caches()
    before = (stats.disk_corrupt, stats.renders, stats.ast_hits)
    prog = cpu.compile(ast)
    # re-rendered; the source-level entry still holds the bytes, so nothing is compiled
    assert (stats.disk_corrupt - before[0], stats.renders - before[1], stats.ast_hits - before[2]) == (1, 1, 0)
    assert bin_path.read_bytes() == good and DiskCache().get(key) is not None      # rewritten, valid again
    x, got = run_times_two(cpu, prog, rng)
    np.testing.assert_allclose(got, x * np.float32(tag))


def _truncate_both(cpu, ast) -> int:
    for path in (ast_entry_paths(cpu, ast)[0], entry_paths(cpu, ast)[0]):
        path.write_bytes(path.read_bytes()[:10])
    return 2        # corrupt entries found


def _remove_source_entry(cpu, ast) -> int:
    for path in entry_paths(cpu, ast)[:2]:
        path.unlink()
    return 0


@pytest.mark.parametrize("damage", [_truncate_both, _remove_source_entry], ids=["both corrupt", "source gone"])
def test_without_usable_compiled_bytes_the_kernel_is_recompiled_and_still_correct(cpu, cache_dir, rng, damage):
    tag = fresh_tag()
    ast = unique_kernel(tag)
    cpu.compile(ast)
    corrupt = damage(cpu, ast)
    cache.clear_memory_caches()
    before = (stats.compiles, stats.disk_corrupt, stats.disk_hits)
    prog = cpu.compile(ast)
    assert (stats.compiles - before[0], stats.disk_corrupt - before[1], stats.disk_hits - before[2]) == (1, corrupt, 0)
    x, got = run_times_two(cpu, prog, rng)
    np.testing.assert_allclose(got, x * np.float32(tag))


def test_debug_level_2_still_prints_the_source_on_a_warm_cache(cpu, cache_dir, monkeypatch, capfd):
    ast = unique_kernel()
    cpu.compile(ast, "warm_dbg")
    cache.clear_memory_caches()
    capfd.readouterr()
    monkeypatch.setenv("MOROK_DEBUG", "2")
    cpu.compile(ast, "warm_dbg")
    assert "define void @k_warm_dbg" in capfd.readouterr().err


# ---- the AST-level key -----------------------------------------------------------------------------

def test_ast_key_is_deterministic_and_depends_on_every_input(cpu):
    import copy
    import dataclasses
    renderer, compiler = cpu.pair()
    a, b = unique_kernel(1.5), unique_kernel(2.5)
    key = cache.ast_key(renderer, compiler, a, "k")
    assert key == cache.ast_key(renderer, compiler, a, "k")
    assert key != cache.ast_key(renderer, compiler, b, "k")
    assert key != cache.ast_key(renderer, compiler, a, "k2")
    for field in dataclasses.fields(renderer.caps):     # every capability is part of it
        other = copy.copy(renderer)
        value = getattr(renderer.caps, field.name)
        changed = {bool: lambda v: not v, int: lambda v: v + 1, tuple: lambda v: (v or (1, 1)) + (1,)}
        new = changed[type(value) if value is not None else tuple](value)
        other.caps = dataclasses.replace(renderer.caps, **{field.name: new})
        assert cache.ast_key(other, compiler, a, "k") != key, field.name
    other = copy.copy(renderer)
    other.triple = "aarch64-unknown-linux-gnu"
    assert cache.ast_key(other, compiler, a, "k") != key
    other_compiler = copy.copy(compiler)
    other_compiler.opt = 2
    assert cache.ast_key(renderer, other_compiler, a, "k") != key


def test_renderer_ordinals_share_entries(cpu):
    import copy
    from morok_py import DeviceSpec
    renderer, compiler = cpu.pair()
    other = copy.copy(renderer)
    other.device = DeviceSpec("CPU", 3)
    assert cache.ast_key(other, compiler, unique_kernel(1.5), "k") == cache.ast_key(renderer, compiler,
                                                                                     unique_kernel(1.5), "k")


def test_a_renderer_setting_without_a_stable_text_gets_no_ast_entries(cpu, cache_dir):
    import copy
    renderer, compiler = cpu.pair()
    other = copy.copy(renderer)
    other.helper = object()           # its repr holds an address: no key could be reproduced
    assert cache.ast_key(other, compiler, unique_kernel(1.5), "k") is None
    before = stats.renders
    compiled = cache.compile_ast(other, compiler, unique_kernel(), "k")
    assert compiled.bytes and stats.renders == before + 1


def test_the_code_fingerprint_follows_the_files_of_the_renderer(tmp_path, cpu, monkeypatch):
    """An edit of lowering or of a printer changes what an AST compiles to: the AST-level key follows
    the module files (path, size, mtime) of morok_py and of the renderer's and compiler's folders."""
    import importlib.util
    pkg = tmp_path / "fake_backend"
    pkg.mkdir()
    mod = pkg / "renderer.py"
    mod.write_text("from backends.cpu.renderer import CPURenderer\n\nclass FakeRenderer(CPURenderer):\n    pass\n")
    spec = importlib.util.spec_from_file_location("fake_backend_renderer", mod)
    m = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fake_backend_renderer", m)
    spec.loader.exec_module(m)
    renderer, compiler = cpu.pair()
    fake = m.FakeRenderer.__new__(m.FakeRenderer)
    fake.__dict__.update(vars(renderer))
    monkeypatch.setattr(cache, "_code_fingerprints", {})
    before = cache.code_fingerprint(fake, compiler)
    assert before != cache.code_fingerprint(renderer, compiler)
    (pkg / "helpers.py").write_text("X = 1\n")          # a sibling module counts too
    cache._code_fingerprints.clear()
    after = cache.code_fingerprint(fake, compiler)
    assert after != before
    os.utime(mod, ns=(1, 1))
    cache._code_fingerprints.clear()
    assert cache.code_fingerprint(fake, compiler) != after


# ---- cheap compiler identities ----------------------------------------------------------------------

def test_file_identity_changes_with_the_file(tmp_path):
    f = tmp_path / "libfake.so"
    f.write_bytes(b"x" * 10)
    first = cache.file_identity(str(f))
    os.utime(f, ns=(10**18, 10**18))
    assert cache.file_identity(str(f)) != first
    link = tmp_path / "libfake.so.1"
    link.symlink_to(f)
    assert cache.file_identity(str(link)) == cache.file_identity(str(f))      # resolved


def test_llvmlite_identity_names_its_version_file_and_library_without_importing_it():
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); from morok_py import cache; "
            "print(json.dumps([cache.llvmlite_identity(), 'llvmlite' in sys.modules]))")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, check=True)
    ident, imported = json.loads(res.stdout.strip().splitlines()[-1])
    assert not imported
    assert "/llvmlite/_version.py:" in ident and "libllvmlite" in ident
    assert ident == cache.llvmlite_identity()


IDENTITY_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from morok_py.backends.{backend} import compile_only_pairs
idents = {{c.cache_key: c.cache_identity() for r, c in compile_only_pairs({arch!r})
           if hasattr(c, "cache_identity")}}
maps = open("/proc/self/maps").read()
print(json.dumps({{"idents": idents, "llvm_binding": "llvmlite.binding" in sys.modules,
                  "pathfinder": "cuda.pathfinder" in sys.modules,
                  "libs": sorted(l for l in ("libnvrtc", "libnvJitLink", "libllvmlite") if l in maps),
                  "lld_run": bool(getattr(sys.modules.get("morok_py.backends.rocm.compiler"), "_linker_cache", None))}}))
"""


def _identities_in_a_fresh_process(backend: str, arch: str, env: dict | None = None, preload: str = "") -> dict:
    code = preload + IDENTITY_CHILD.format(backend=backend, arch=arch)
    res = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, check=True,
                         env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_cuda_cache_identities_load_no_library():
    pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed")
    from morok_py.backends.cuda.compiler import locate_library
    if locate_library("nvrtc") is None or locate_library("nvJitLink") is None:
        pytest.skip("NVRTC / nvJitLink are not in the pip wheels here: their identity loads them")
    got = _identities_in_a_fresh_process("cuda", "sm_90")
    assert set(got["idents"]) == {"nvrtc", "llvm-nvptx", "mlir"}   # mlir: its libraries by file, not imported
    assert not got["llvm_binding"] and got["libs"] == []
    assert "libnvrtc" in got["idents"]["nvrtc"] and "sm_90" in got["idents"]["nvrtc"]
    assert "libnvJitLink" in got["idents"]["llvm-nvptx"] and "libllvmlite" in got["idents"]["llvm-nvptx"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_cuda_library_paths_are_remembered_per_environment(tmp_path):
    """Finding libnvrtc through cuda-pathfinder costs 20-80 ms of imports: the first fresh process
    finds it and remembers the path; the next one neither imports cuda-pathfinder nor loads anything,
    and names the same files. A copy already loaded in the process is asked about instead."""
    pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed")
    from morok_py.backends.cuda.compiler import locate_library
    if locate_library("nvrtc") is None or locate_library("nvJitLink") is None:
        pytest.skip("NVRTC / nvJitLink are not in the pip wheels here: their identity loads them")
    env = dict(os.environ, MOROK_CACHE_DIR=str(tmp_path / "c"))
    env.pop("MOROK_CACHE", None)
    first = _identities_in_a_fresh_process("cuda", "sm_90", env)
    second = _identities_in_a_fresh_process("cuda", "sm_90", env)
    assert first["pathfinder"] and not second["pathfinder"]
    assert second["idents"] == first["idents"] and second["libs"] == []


def test_a_compile_keys_its_output_by_the_library_it_loaded(cache_dir, monkeypatch, tmp_path):
    """A lookup names the remembered library without loading it; a compile loads the library, and its
    output is written under the file actually loaded (here the remembered path names another file,
    as when torch or CuPy loaded their own copy first)."""
    pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed")
    from morok_py import kernels as K
    from morok_py.backends.cuda import compile_only_pairs
    from morok_py.backends.cuda import compiler as CC
    r, c = next((r, c) for r, c in compile_only_pairs("sm_90") if c.cache_key == "nvrtc")
    if c.available() is not None:
        pytest.skip(f"NVRTC is not usable here: {c.available()}")
    fake = tmp_path / "libnvrtc.so.remembered"
    fake.write_bytes(b"not the library")
    monkeypatch.setattr(CC, "_loaded_from", {})
    monkeypatch.setattr(CC, "_remembered", lambda name: str(fake))
    assert str(fake) in CC.library_identity("nvrtc")
    spec = r.render(K.named("add"), "keyed_by_loaded")
    looked_up = cache.disk_key(c, spec)
    cache.compile_spec(c, spec)                       # a miss: compiles, loading libnvrtc
    loaded = CC.library_identity("nvrtc")
    assert str(fake) not in loaded and "libnvrtc" in loaded
    written = cache.disk_key(c, spec)
    assert written != looked_up
    assert (cache_dir / written[:2] / f"{written}.bin").is_file()
    assert not (cache_dir / looked_up[:2] / f"{looked_up}.bin").exists()
    hits = cache.stats.disk_hits
    assert cache.compile_spec(c, spec).bytes is not None and cache.stats.disk_hits == hits + 1


def test_remembered_path_is_per_environment_and_checked(cache_dir, tmp_path, monkeypatch):
    lib = tmp_path / "libthing.so"
    lib.write_bytes(b"x")
    calls = []

    def find():
        calls.append(1)
        return str(lib)

    assert cache.remembered_path("t/libthing", find) == str(lib) and len(calls) == 1
    assert cache.remembered_path("t/libthing", find) == str(lib) and len(calls) == 1   # remembered
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))        # another environment: found again
    assert cache.remembered_path("t/libthing", find) == str(lib) and len(calls) == 2
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    monkeypatch.setattr(sys, "path", [str(tmp_path / "script"), *sys.path, str(site_dir)])
    assert cache.remembered_path("t/libthing", find) == str(lib) and len(calls) == 3   # another sys.path
    assert cache.remembered_path("t/libthing", find) == str(lib) and len(calls) == 3
    (tmp_path / "script").mkdir()                               # a file saved beside the script: the same
    (tmp_path / "script" / "notes.txt").write_text("x")
    assert cache.remembered_path("t/libthing", find) == str(lib) and len(calls) == 3
    (site_dir / "new_package").mkdir()                          # a package installed: found again
    os.utime(site_dir, ns=(10**18, 10**18))
    assert cache.remembered_path("t/libthing", find) == str(lib) and len(calls) == 4
    lib.unlink()                                                # a remembered file that is gone
    other = tmp_path / "libthing2.so"
    other.write_bytes(b"y")
    assert cache.remembered_path("t/libthing", lambda: str(other)) == str(other)
    for meta in cache_dir.rglob("*.json"):                      # a corrupt entry: found again
        meta.write_text("{not json")
    assert cache.remembered_path("t/libthing", find) == str(lib) and len(calls) == 5
    monkeypatch.setenv("MOROK_CACHE", "0")                     # no disk cache: found every time
    cache.remembered_path("t/libthing", find)
    cache.remembered_path("t/libthing", find)
    assert len(calls) == 7


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_amdgpu_cache_identity_initializes_no_llvm_and_runs_no_linker():
    got = _identities_in_a_fresh_process("rocm", "gfx942")
    assert "llvm-amdgpu" in got["idents"]
    assert not got["llvm_binding"] and "libllvmlite" not in got["libs"] and not got["lld_run"]
    assert "gfx942" in got["idents"]["llvm-amdgpu"] and "libllvmlite" in got["idents"]["llvm-amdgpu"]


def test_amdgpu_cache_identity_follows_the_linker(tmp_path, monkeypatch):
    from morok_py.backends.rocm import compiler as R
    lld = tmp_path / "ld.lld"
    lld.write_text("#!/bin/sh\necho 'LLD 20.1.0'\n")
    lld.chmod(0o755)
    monkeypatch.setenv("MOROK_LLD", str(lld))
    first = R.lld_identity()
    assert str(lld) in first
    os.utime(lld, ns=(10**18, 10**18))
    monkeypatch.setattr(R, "_lld_identities", {})
    assert R.lld_identity() != first


CUDA_HIT_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from morok_py import cache, kernels as K
from morok_py.backends.cuda import compile_only_pairs
out = {}
for r, c in compile_only_pairs("sm_90"):
    compiled = cache.compile_ast(r, c, K.named("softmax"), "cuda_hit")
    out[c.cache_key] = compiled.bytes.hex()
maps = open("/proc/self/maps").read()
print(json.dumps({"bytes": out, "renders": cache.stats.renders, "compiles": cache.stats.compiles,
                  "ast_hits": cache.stats.ast_hits, "libs": [l for l in ("libnvrtc", "libnvJitLink") if l in maps],
                  "llvm_binding": "llvmlite.binding" in sys.modules}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_cuda_hit_in_a_fresh_process_loads_neither_nvrtc_nor_llvm(cache_dir):
    pytest.importorskip("cuda.bindings", reason="the cuda extra is not installed")
    from morok_py import kernels as K
    from morok_py.backends.cuda import compile_only_pairs
    from morok_py.backends.cuda.compiler import locate_library
    pairs = compile_only_pairs("sm_90")
    if any(c.available() is not None for _, c in pairs) or locate_library("nvrtc") is None:
        pytest.skip("NVRTC or nvJitLink is not usable here")
    got, cold = populate_then_run_child(
        lambda: {c.cache_key: cache.compile_ast(r, c, K.named("softmax"), "cuda_hit").bytes for r, c in pairs},
        pairs, CUDA_HIT_CHILD, str(ROOT))
    assert (got["renders"], got["compiles"], got["ast_hits"]) == (0, 0, len(pairs)), got["log"]
    assert got["libs"] == [] and not got["llvm_binding"]
    assert {k: bytes.fromhex(v) for k, v in got["bytes"].items()} == cold
