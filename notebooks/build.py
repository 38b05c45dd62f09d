"""Build and execute the notebooks in this directory: ``make notebooks``.

Each notebook is written here as a list of cells (markdown and code), so its
text is reviewed like code; this script writes the ``.ipynb`` files, executes
them in this directory with nbclient, and stores them with their outputs (so
tables and plots show on any notebook viewer without running anything).
``tests/test_notebooks.py`` executes the stored notebooks again, so they never rot.

    python notebooks/build.py            # every notebook
    python notebooks/build.py 1_torch    # those whose file name starts with it
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def md(text: str) -> tuple[str, str]:
    return ("markdown", text.strip("\n"))


def code(text: str) -> tuple[str, str]:
    return ("code", text.strip("\n"))


#: First lines of every notebook: 8 simulated CPU devices for JAX (set before jax is imported)
#: and a scratch directory that every path below is relative to.
SETUP = """
import os, sys, tempfile
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.chdir(tempfile.mkdtemp(prefix="xckpt-nb{n}-"))  # a scratch directory: every path below is relative
"""

TORCH_TO_JAX = [
    md("""
# From PyTorch ranks to JAX devices

A training job saves its state from 2 PyTorch ranks; an evaluation job wants the
weights in JAX, on 8 devices, sharded another way. This notebook follows the
checkpoint from one to the other:

1. save DTensors from 2 real `torch.distributed` ranks with `xckpt.torch.save`;
2. look at what was written (`xckpt.open`), and draw the saved layout against the JAX target;
3. plan the load before reading a byte (`xckpt.plan_load`);
4. load into JAX (`xckpt.jax.load`) and check every element.

Every cell runs as written: the test suite executes this notebook.
"""),
    code(SETUP.format(n=1)),
    md("""
## 1. Save from 2 PyTorch ranks

A real `torch.distributed` job with 2 ranks (the gloo backend, on CPU). Its state:

* `model.embed`, 32768 x 128 float32 (16 MiB), sharded by rows (`Shard(0)`): each rank holds half the rows;
* `model.proj`, 64 x 96 bfloat16, sharded by columns (`Shard(1)`);
* `model.bias`, a plain tensor every rank holds the same copy of (replicated);
* `step`, a Python int.

`xckpt.torch.save` writes every distinct piece once (the replicated bias by one rank
only) and records where each piece sits in the global tensor.
"""),
    code('''
%%writefile train.py
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import xckpt.torch as xt

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
g = torch.Generator().manual_seed(0)
embed, proj = torch.randn(32768, 128, generator=g), torch.randn(64, 96, generator=g)
state = {
    "model": {
        "embed": distribute_tensor(embed, mesh, [Shard(0)]),
        "proj": distribute_tensor(proj.to(torch.bfloat16), mesh, [Shard(1)]),
        "bias": torch.arange(96, dtype=torch.float32),
    },
    "step": 100,
}
xt.save(state, sys.argv[1], show_progress=False)
dist.destroy_process_group()
'''),
    md("""
`torch.distributed.run` starts the 2 ranks; the checkpoint goes to `step-100`.
"""),
    code("""
!OMP_NUM_THREADS=1 {sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 train.py step-100
assert os.path.exists("step-100/xckpt.json"), "the save did not complete: see the ranks' output above"
"""),
    md("""
## 2. Look at it

`xckpt.open` reads the manifests only, never the tensor data, so this is instant even for a
large checkpoint. Each row is a tensor: its chunks (with a glyph: `2x1` is 2 pieces along
the rows, 1 along the columns), a thumbnail of the pieces coloured by the rank that wrote
them, and how many bytes each writer holds. The bias was written by one rank only.
"""),
    code("""
import xckpt
ck = xckpt.open("step-100")
ck
"""),
    md("""
Now the target. The evaluation job has 8 JAX devices (simulated on this CPU) in a 4 x 2
mesh with axes `data` and `model`:

* `embed` is split by rows over all 8 devices;
* `proj` is split by columns over the 2-way `model` axis and replicated over `data`;
* `bias` is replicated everywhere.

`plot_layout` draws the saved pieces coloured by the writer, and outlines the box each
device will hold (labelled with the devices that hold it).
"""),
    code("""
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((4, 2), ("data", "model"))
target = {
    "model.embed": NamedSharding(mesh, P(("data", "model"), None)),
    "model.proj": NamedSharding(mesh, P(None, "model")),
    "model.bias": NamedSharding(mesh, P()),
}
ck.plot_layout("model.embed", target=target["model.embed"]);
"""),
    md("""
Each device's rows lie inside one writer's piece: devices 0-3 read only from what rank 0
wrote, devices 4-7 from rank 1. For `proj` the saved split and the target split are the
same columns, and each column half is held by 4 devices (replicas along `data`):
"""),
    code("""
ck.plot_layout("model.proj", target=target["model.proj"]);
"""),
    md("""
## 3. Plan the load

`xckpt.plan_load` is a dry run from metadata alone: for each device, the bytes it will
read, in how many reads, the over-read (bytes read / bytes it keeps) and the host memory
the load needs. The same dry run is `xckpt plan` on the command line.

`embed` (16 MiB) was saved as two 8 MiB pieces, each stored in 8 inner chunks of 1 MiB
(2048 rows, the dotted lines in the plot above), so a device holding 1/8 of the rows reads
its own 2 inner chunks, 2 MiB, and nothing more. Small
tensors (`proj`, `bias`) are packed together in one stored array and read whole: a few KiB
more than each device keeps, counted honestly.
"""),
    code("""
plan = xckpt.plan_load("step-100", target)
print(plan)
plan.plot();
"""),
    md("""
## 4. Load into JAX

`xckpt.jax.load` builds each `jax.Array` with the target's sharding; each device reads
only the stored chunks its box overlaps. Every element is compared with the tensors the
ranks saved (bfloat16 bit for bit).
"""),
    code("""
import torch
import xckpt.jax as xj

params = xj.load("step-100", target)
g = torch.Generator().manual_seed(0)
embed, proj = torch.randn(32768, 128, generator=g), torch.randn(64, 96, generator=g)
assert np.array_equal(np.asarray(params["model.embed"]), embed.numpy())
assert np.array_equal(np.asarray(params["model.proj"]).view(np.uint16),
                      proj.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
assert np.array_equal(np.asarray(params["model.bias"]), np.arange(96, dtype=np.float32))
{name: (a.shape, a.dtype, a.sharding.spec) for name, a in params.items()}
"""),
    md("""
The step is an object, not a tensor: `ck.objects()` returns it.
"""),
    code("""
ck.objects()
"""),
]

FOREIGN_FORMATS = [
    md("""
# Inspecting foreign checkpoints: a torch DCP and a Hugging Face directory

xckpt reads checkpoints it did not write, in place, from their metadata: PyTorch's
Distributed Checkpoint (DCP), orbax, safetensors files and Hugging Face directories, and
`torch.save` files (without unpickling them). This notebook takes two of them side by side:

* a DCP checkpoint saved by 2 PyTorch ranks with `torch.distributed.checkpoint.save`;
* a Hugging Face model directory written by `transformers`' `save_pretrained`, in 5 shards.

For each: the table and the layout, a conversion to xckpt, `xckpt diff --values` to show
nothing changed, `verify`, and finally a dry run (`xckpt plan`) of loading the DCP at
another world size.
"""),
    code(SETUP.format(n=2)),
    md("""
## Two checkpoints from other libraries

The DCP comes from 2 gloo ranks: `embed` and `head` are DTensors sharded by rows
(`Shard(0)`), `norm` a plain tensor every rank holds (replicated), `step` an int.
Nothing from xckpt is involved in writing it.
"""),
    code('''
%%writefile save_dcp.py
import sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
g = torch.Generator().manual_seed(0)
state = {
    "model": {
        "embed": distribute_tensor(torch.randn(1024, 64, generator=g), mesh, [Shard(0)]),
        "head": distribute_tensor(torch.randn(256, 64, generator=g).to(torch.bfloat16), mesh, [Shard(0)]),
        "norm": torch.ones(64),
    },
    "step": 1000,
}
dcp.save(state, checkpoint_id=sys.argv[1])
dist.destroy_process_group()
'''),
    code("""
!OMP_NUM_THREADS=1 {sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 save_dcp.py dcp
assert os.path.exists("dcp/.metadata"), "the save did not complete: see the ranks' output above"
sorted(os.listdir("dcp"))
"""),
    md("""
The Hugging Face directory: a tiny Llama (2 layers, hidden size 64) saved with
`max_shard_size="100KB"`, so its 21 tensors spread over 5 `.safetensors` files and an
index that says which file holds which tensor.
"""),
    code("""
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by transformers
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

transformers.utils.logging.disable_progress_bar()
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
LlamaForCausalLM(config).save_pretrained("hf", max_shard_size="100KB")
sorted(os.listdir("hf"))
"""),
    md("""
## Open them

`xckpt.open` detects the format and parses only metadata: DCP's `.metadata` file
(with a restricted unpickler that refuses anything but DCP's own metadata classes) and the
safetensors headers. The tables read the same for both. For the DCP, each writer is a rank;
for the Hugging Face directory, each shard file counts as a writer.

The DCP's `step` is an *object*, which DCP stores as a pickle. xckpt lists it but does not
unpickle it unless asked (`allow_pickle=True`): unpickling can run code stored in the file.
"""),
    code("""
import xckpt
dcp = xckpt.open("dcp")
dcp
"""),
    code("""
print(dcp.object_names(), "pickled:", dcp.pickled_objects())
"""),
    code("""
hf = xckpt.open("hf")
hf
"""),
    md("""
`xckpt` is the command-line tool installed with the package. Here it runs inside this kernel
through `xckpt.cli.main`: `xckpt_cli(["show", "dcp", "model.embed"])` prints what
`xckpt show dcp model.embed` prints in a terminal and returns its exit status.

`xckpt show` (or `ck.info(name)`) tells where each piece of a tensor lives: for a DCP, a
byte range of a rank's `.distcp` file (DCP stores each piece with a small `torch.save`
header, hence the extra bytes); for a Hugging Face directory, a byte range of a shard file.
"""),
    code("""
from xckpt.cli import main as xckpt_cli

xckpt_cli(["show", "dcp", "model.embed"])
xckpt_cli(["show", "hf", "model.layers.0.mlp.up_proj.weight"]);
"""),
    md("""
## Layouts, side by side

Left: the DCP's `embed`, two row blocks (one per saving rank), drawn against a load at
3 ranks, each taking a third of the rows: rank 1's rows straddle both saved blocks.
Right: one of the Llama's MLP weights, a single piece in the second shard file (`writer 1`),
drawn against a
2 x 2 tensor-parallel layout (`Shard(0), Shard(1)`): each rank reads a quarter of it, row
by row, from byte ranges of that file.
"""),
    code("""
import matplotlib.pyplot as plt

fig, (left, right) = plt.subplots(1, 2, figsize=(15, 4.2), layout="constrained")
dcp.plot_layout("model.embed", ax=left, target=((3,), "Shard(0)"))
hf.plot_layout("model.layers.0.mlp.up_proj.weight", ax=right, target=((2, 2), "Shard(0), Shard(1)"));
"""),
    md("""
## Convert to xckpt, and check nothing changed

`xckpt.convert` streams chunk by chunk, keeps the writers' layout, re-reads every written
box against the source (crc32) and only then moves the result into place. The DCP's
pickled `step` is carried over only with `allow_pickle=True` (without it, convert skips it
with a warning naming it).
"""),
    code("""
print(xckpt.convert("dcp", "dcp.xckpt", allow_pickle=True))
print(xckpt.convert("hf", "hf.xckpt"))
"""),
    md("""
`xckpt diff --values` compares two checkpoints of any formats: names, dtypes and shapes,
then every element bit for bit (and objects, here with `--allow-pickle` for the DCP's
step). Exit status 0 means equal.
"""),
    code("""
print("exit status", xckpt_cli(["diff", "--values", "--allow-pickle", "dcp", "dcp.xckpt"]))
print("exit status", xckpt_cli(["diff", "--values", "hf", "hf.xckpt"]))
"""),
    md("""
`verify()` reads every stored chunk and object. xckpt checks each against its crc32; the
foreign formats store no checksums, so for them every byte range must be present and
readable. An empty list means no problem found.
"""),
    code("""
for name in ("dcp", "dcp.xckpt", "hf", "hf.xckpt"):
    src = xckpt.open(name)
    print(f"{name:10} {src.format:12} {len(src.names())} tensors  problems: {src.verify()}")
"""),
    md("""
## Plan a load of the DCP at another world size

Before launching a job at 3 ranks, ask what each rank would read. `xckpt plan` lays every
tensor out as `Shard(0)` over the given world size (or `--mesh 2,2 --placement "Shard(0),
Shard(1)"`, `--json` for scripts) and reads nothing but metadata. Rank 1 reads from both
saved files (more reads), yet no rank reads more than it keeps: DCP pieces are read by
byte ranges of rows.
"""),
    code("""
xckpt_cli(["plan", "dcp", "--world-size", "3"]);
"""),
]

VALUE_GROUPS = [
    md("""
# A managed-collision table, resharded by value from 2 ranks to 3

Most sharded state is split by *position*: rank r holds rows `r*n/W` to `(r+1)*n/W`, and
loading at another world size just cuts the rows differently. torchrec's managed-collision
(ZCH) modules are different: their state is partitioned by *value*. A raw id (any int64)
goes to the rank owning its block of the input domain; that rank keeps a sorted list of the
ids it has seen and maps each to a row of its slice of the embedding table. Cut such a table
by position at another world size and ids land on ranks that will never be asked for them.

xckpt records a value-range annotation with the save and, at a new world size, moves
every entry to the rank that owns its value: the id, its row of the weight and its row of
the optimizer state travel together, and rows are re-slotted on arrival.

The table here is torchrec's layout built by hand in `examples/demo_value_groups.py`:
3000 rows, 2400 ids drawn over torchrec's default input domain 2**63-1, with Adagrad momentum.
"""),
    code("""
import os, sys, tempfile
sys.path.insert(0, os.path.abspath("../examples"))  # this notebook starts in notebooks/
os.chdir(tempfile.mkdtemp(prefix="xckpt-nb3-"))  # a scratch directory: every path below is relative
import numpy as np
import demo_value_groups as demo
import xckpt

path = "mch"
demo.run(2, path, "save")  # 2 real gloo ranks save their shards with xckpt.torch.save
ck = xckpt.open(path)
ck
"""),
    md("""
## The value ranges

The sorted raw ids are the key of the group. Each bar below is a saved chunk of them,
spanning the key values it holds (rank 0 saved ids from the lower half of the domain,
rank 1 from the upper half). The shaded blocks are the input domain split among 3 ranks,
as torchrec splits it: whoever owns a block after the load must hold every id in it. The
middle rank, `new rank 1`, takes ids from both saved chunks.
"""),
    code("""
ck.plot_value_ranges(demo.NAMES["raw"], world_size=3);
"""),
    md("""
## Load at 3 ranks and look every id up

First, record what every id maps to before the move: its weight row and momentum row.
Then 3 fresh gloo ranks load the checkpoint into tables built for world size 3 (each
calls `xckpt.torch.load`). Finally every id is looked up as torchrec does at 3 ranks: sent
to its input owner, searched in that rank's sorted ids, its row read, and the weight and
momentum compared bit for bit with what it had before.
"""),
    code("""
before = {}
for r in range(2):
    st = demo.trained_state(r, 2)
    lo = demo.bounds(demo.N, 2)[r]
    for x, row in zip(st[demo.NAMES["raw"]], st[demo.NAMES["rows"]]):
        if x != demo.INT64_MAX:  # INT64_MAX marks an empty slot
            before[int(x)] = (st[demo.NAMES["weight"]][row - lo], st[demo.NAMES["mom"]][row - lo])
results = demo.run(3, path, "load")
loaded = [state for state, _ in results]
found, lost = demo.check(loaded, before)
print(f"{len(before)} ids: {found} found with their own rows at 3 ranks, {lost} lost; "
      f"evicted per rank: {[ev for _, ev in results]}")
assert lost == 0 and found == len(before)
"""),
    md("""
## For contrast: the same checkpoint cut by position

A loader that knows nothing of values gives each of the 3 ranks a third of every tensor's
rows (re-sorting the ids so searches still work). The lookups tell what that costs:
"""),
    code("""
positional = []
for r in range(3):
    lo, hi = demo.bounds(demo.N, 3)[r], demo.bounds(demo.N, 3)[r + 1]
    st = {n: ck.read(n, slice(lo, hi)) for k, n in demo.NAMES.items() if k not in ("seg", "iter")}
    order = np.argsort(st[demo.NAMES["raw"]], kind="stable")
    for k in ("raw", "rows", "counts"):
        st[demo.NAMES[k]] = st[demo.NAMES[k]][order]
    positional.append(st)
found_p, lost_p = demo.check(positional, before)
print(f"cut by position: {found_p} of {len(before)} ids found, {lost_p} lost")
assert lost_p > 0
"""),
]

CONVERT_WITH_RULES = [
    md("""
# Convert with rules: a PyTorch model's weights into the same flax model

A model is trained in PyTorch; the same architecture exists in flax.linen. The weights
differ only in names and axis order: torch's `Linear.weight` is `(out, in)`, flax's
`Dense.kernel` is `(in, out)`; a `Conv2d` weight is `OIHW`, a flax `Conv` kernel `HWIO`;
`LayerNorm.weight` is flax's `scale`. xckpt ships these rules as `rules="torch_to_flax"`
(see `xckpt/rulesets/torch_to_flax.json`): a lazy *view* over the checkpoint, nothing
copied or rewritten on disk.

This notebook saves the torch weights, loads them into flax through the rules, sharded
over 8 JAX devices, compares the two models' outputs, and plans the load to show that a
transposed view still reads only each device's own bytes.
"""),
    code(SETUP.format(n=4)),
    md("""
## The model, twice

A small image classifier: a patchifying `Conv2d` stem (4 x 4 patches to 512 channels),
averaged over the image, a `LayerNorm`, then an MLP with a wide hidden layer (512 to 4096,
an 8 MiB weight) and 10 outputs. The flax version names its submodules as the torch
modules are named (`name="fc1"`); that is all the rules need. flax takes images as NHWC.
"""),
    code("""
import numpy as np
import torch
from torch import nn
import jax
import jax.numpy as jnp
import flax.linen as fnn


class TorchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 512, kernel_size=4, stride=4)
        self.ln = nn.LayerNorm(512)
        self.fc1 = nn.Linear(512, 4096)
        self.fc2 = nn.Linear(4096, 10)

    def forward(self, img):  # NCHW
        x = self.stem(img).mean((2, 3))
        return self.fc2(torch.relu(self.fc1(self.ln(x))))


class FlaxNet(fnn.Module):
    @fnn.compact
    def __call__(self, img):  # NHWC
        x = fnn.Conv(512, (4, 4), strides=(4, 4), padding="VALID", name="stem")(img).mean((1, 2))
        x = fnn.LayerNorm(epsilon=1e-5, name="ln")(x)
        return fnn.Dense(10, name="fc2")(jax.nn.relu(fnn.Dense(4096, name="fc1")(x)))
"""),
    md("""
## Save the torch weights

`xckpt.torch.save` from a single process (no process group needed). The LayerNorm gets
non-trivial parameters so that a mix-up of `scale` and `bias` would show in the outputs.
"""),
    code("""
import xckpt
import xckpt.torch as xt

torch.manual_seed(0)
model = TorchNet().eval()
with torch.no_grad():
    model.ln.weight.normal_()
    model.ln.bias.normal_()
xt.save(model.state_dict(), "torch-weights")
xckpt.open("torch-weights")
"""),
    md("""
## The view through the rules

`xckpt.open(path, rules="torch_to_flax")` shows the checkpoint as flax will see it:
flax names (`params.fc1.kernel`), flax shapes. The stored bytes are untouched.
"""),
    code("""
view = xckpt.open("torch-weights", rules="torch_to_flax")
view
"""),
    md("""
`info` of the kernel: the transposed shape `(512, 4096)`, and its chunk, which still points
at the stored array of `fc1.weight` (`key`). `grid` is the inner chunking, transposed too:
the stored `(4096, 512)` weight is kept in 8 inner chunks of 512 torch rows (1 MiB each),
which in the view are 8 blocks of 512 *columns* of the kernel.
"""),
    code("""
print("stored:", xckpt.open("torch-weights").info("fc1.weight"))
print("view:  ", view.info("params.fc1.kernel"))
"""),
    md("""
## Load into flax, sharded over 8 devices

The target is the flax variables' shapes (`jax.eval_shape`: no initialisation runs) with a
sharding per leaf: `fc1` split along its output features over the 8 devices (the
kernel's columns, the bias), `fc2`'s kernel along its input features (the same hidden
units), everything else replicated. `xckpt.jax.load(path, target, rules="torch_to_flax")`
fills each device's shard through the view.

(The mesh's axis type is `Auto` so that `fc2`'s sharded contracting dim is left to the
compiler.)
"""),
    code("""
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import xckpt.jax as xj

mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
img = np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32)
shapes = jax.eval_shape(FlaxNet().init, jax.random.key(0), img.transpose(0, 2, 3, 1))
specs = {("fc1", "kernel"): P(None, "model"), ("fc1", "bias"): P("model"), ("fc2", "kernel"): P("model", None)}


def sharded(path, leaf):
    spec = specs.get(tuple(k.key for k in path[1:]), P())
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))


target = jax.tree_util.tree_map_with_path(sharded, shapes)
variables = xj.load("torch-weights", target, rules="torch_to_flax")
jax.tree_util.tree_map(lambda a: f"{a.shape} {a.sharding.spec}", variables)
"""),
    md("""
## Same outputs

The same 4 images through both models (NCHW for torch, NHWC for flax):
"""),
    code("""
with torch.no_grad():
    want = model(torch.from_numpy(img)).numpy()
got = np.asarray(jax.jit(FlaxNet().apply)(variables, jnp.asarray(img.transpose(0, 2, 3, 1))))
print("max |flax - torch| =", np.abs(got - want).max())
np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
"""),
    md("""
## What each device read

The layout of the kernel in the view, against the target: one saved piece (a single
process wrote it), its 8 inner chunks (dotted lines) and 8 devices, each holding 512 of
the 4096 columns: one inner chunk each.
"""),
    code("""
view.plot_layout("params.fc1.kernel", target=target["params"]["fc1"]["kernel"].sharding);
"""),
    md("""
`xckpt.plan_load` runs the same load as a dry run, from metadata, with the same rules:
"""),
    code("""
plan = xckpt.plan_load("torch-weights", target, rules="torch_to_flax")
print(plan)
plan.plot();
"""),
    md("""
Why a transposed view still reads only each device's bytes: the view never materialises
the transposed tensor. A device's box in the kernel, columns `512*d` to `512*(d+1)` of
`(512, 4096)`, is mapped back through the permutation to a box of the stored weight: rows
`512*d` to `512*(d+1)` of `(4096, 512)`, which is exactly one inner chunk. The device reads
that 1 MiB, transposes it in memory and keeps it. The rest of each device's 1.3 MiB is the
small tensors (stem, norm, `fc2`, biases: 0.27 MiB in all), packed into one stored array
and read whole, though a device keeps only its part of them.

The mapping is exact, but the stored order still matters. Shard the kernel along its
*input* dim instead (`P("model", None)`) and each device's box maps to a column block of
the stored weight, which cuts through every inner chunk: each device must read all 8 MiB to
keep 1 MiB. The plan says so before anything is read:
"""),
    code("""
specs[("fc1", "kernel")] = P("model", None)
across = xckpt.plan_load("torch-weights", jax.tree_util.tree_map_with_path(sharded, shapes), rules="torch_to_flax")
print(across.summary())
"""),
]


NOTEBOOKS: dict[str, list[tuple[str, str]]] = {
    "1_torch_to_jax.ipynb": TORCH_TO_JAX,
    "2_foreign_formats.ipynb": FOREIGN_FORMATS,
    "3_value_groups.ipynb": VALUE_GROUPS,
    "4_convert_with_rules.ipynb": CONVERT_WITH_RULES,
}


def build(name: str, cells: list[tuple[str, str]]) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
        for kind, src in cells
    ]
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    for cell in nb.cells:  # stable files: no execution timestamps
        cell.get("metadata", {}).pop("execution", None)
    nbformat.write(nb, HERE / name)
    print(f"wrote {HERE / name}")


def main(argv: list[str]) -> None:
    for name, cells in NOTEBOOKS.items():
        if not argv or any(name.startswith(a) for a in argv):
            build(name, cells)


if __name__ == "__main__":
    main(sys.argv[1:])
