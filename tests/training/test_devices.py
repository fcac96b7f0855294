"""The main job on an accelerator, checked without one.

No GPU is needed: the run's device is a stand-in (tests/device_stand_in.py), torch's ``meta``
device under a ``FakeTensorMode``. Every op that mixes a tensor on the stand-in with one on the
CPU fails there as it would on CUDA, so a batch, a checkpoint or a reduction left on the host is
caught, and so is a random draw from a generator on the wrong device; host-device traffic is
counted per step. ``torch.cuda``'s device functions, NCCL's one-GPU-per-rank rule and DDP's
``device_ids`` are stood in for by fakes that check their arguments as torch does. What the run
computes is checked on the CPU by tests/test_train.py. The host keeps real tensors where a real
run has them: decoded images, freshly built models, checkpoints read from disk.
"""

from __future__ import annotations

import platform
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from device_stand_in import STAND_IN, FakeCuda, StandIn, fake_ddp, fake_nccl
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

import train_cifar as T
from vitattn import registry
from vitattn.tasks import classify
from vitattn.tasks.classify import batches, report, setup
from vitattn.training import checkpoint, loop, runtime
from vitattn.training.cli import UsageError


def on_host(fn):
    """``fn`` run with real tensors, as the host runs it in a real job."""
    def wrapped(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    return wrapped


def keep_on_host(monkeypatch) -> None:
    """Decoding, model building and checkpoint reading run on the host with real tensors; files
    and report text (no device work) are not written from fake values."""
    original_tolist = torch.Tensor.tolist

    def tolist(t):
        if isinstance(t, FakeTensor) or t.is_meta:
            with unset_fake_temporarily():
                return torch.zeros(t.shape, dtype=torch.float64).tolist()
        return original_tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(setup, "load_cifar", on_host(setup.load_cifar))
    monkeypatch.setattr(registry, "create_model", on_host(registry.create_model))
    monkeypatch.setattr(checkpoint, "load_checkpoint", on_host(checkpoint.load_checkpoint))
    monkeypatch.setattr(setup, "flops_per_image", lambda model, size: 0)  # counts on its own meta copy
    for name in ("save_atomic", "save_safetensors"):
        monkeypatch.setattr(checkpoint, name, lambda *a, **k: None)
    monkeypatch.setattr(report, "write_report", lambda *a, **k: None)


def enter_stand_in(monkeypatch) -> StandIn:
    keep_on_host(monkeypatch)
    mode = StandIn()
    on_device = mode.device_generator(runtime.step_generator)
    monkeypatch.setattr(batches, "step_generator", on_device)  # the name batches imported, and the module's
    monkeypatch.setattr(runtime, "step_generator", on_device)
    return mode


@pytest.fixture
def stand_in(monkeypatch):
    with enter_stand_in(monkeypatch) as mode:
        yield mode


def config(tmp_path: Path, folder: Path, **kw) -> classify.Config:
    base = dict(data_dir=str(folder), out=str(tmp_path / "run"), model="both", cnn_preset="cnn_quick",
                vit_preset="vit_quick", epochs=2, batch_size=12, lr=0.05, progress=False, plots=False,
                context_images=8, device="meta", channels_last=False)  # fake tensors do not change layout
    return classify.Config(**{**base, **kw})


def test_the_stand_in_catches_a_batch_left_on_the_host(stand_in):
    norm = classify.data.Normalize().to(STAND_IN)
    with pytest.raises(RuntimeError, match="device"):
        norm(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))


@pytest.mark.parametrize("amp", [{}, dict(amp=True, amp_dtype="bfloat16"), dict(amp=True, amp_dtype="float16")],
                         ids=["fp32", "bf16", "fp16"])
def test_a_fresh_run_keeps_data_model_and_sums_on_the_device(tmp_path, folder, stand_in, amp, monkeypatch):
    if amp:  # autocast has no meta backend: the CPU's is taken, which leaves meta ops as they are
        cpu_autocast = runtime.autocast  # the loop's, the one autocast a run has
        monkeypatch.setattr(runtime, "autocast", lambda device, dtype: cpu_autocast("cpu", dtype))
    s = T.main(config(tmp_path, folder, tta=True, **amp))
    assert s["status"] == "ok" and set(s["models"]) == {"vit", "cnn"}
    assert next(s["modules"]["vit"].parameters()).device == STAND_IN


# loading into the stand-in's meta parameters copies nothing, as torch warns for each tensor: expected here
@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter:UserWarning")
def test_a_run_resumes_on_the_device_from_a_checkpoint_read_on_the_host(tmp_path, folder, monkeypatch):
    cfg = config(tmp_path, folder, model="cnn", device="cpu", epochs=3)
    calls = {"n": 0}
    cross_entropy = classify.task.F.cross_entropy

    def interrupt(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            signal.raise_signal(signal.SIGINT)
        return cross_entropy(*args, **kw)

    monkeypatch.setattr(classify.task.F, "cross_entropy", interrupt)
    assert T.main(cfg)["status"] == "interrupted"
    monkeypatch.setattr(classify.task.F, "cross_entropy", cross_entropy)
    saved = (Path(cfg.out) / "config.json").read_text().replace('"device": "cpu"', '"device": "meta"')
    (Path(cfg.out) / "config.json").write_text(saved)
    with enter_stand_in(monkeypatch):
        s = T.main(classify.Config(resume=cfg.out, progress=False))
    assert s["status"] == "ok"


def test_two_ranks_reduce_only_tensors_on_the_device(tmp_path, folder, stand_in, monkeypatch):
    """NCCL reduces GPU tensors only ("No backend type associated with device type cpu"); the fake
    process group takes anything, so every collective is checked here as NCCL would."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    reduced = []

    def nccl_like(t, *args, **kwargs):
        if t.device != STAND_IN:
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        reduced.append(tuple(t.shape))

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        monkeypatch.setattr(dist, "all_reduce", nccl_like)
        monkeypatch.setattr(dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj] * 2))
        monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda m, **k: m)  # DDP: tests/test_train.py
        monkeypatch.setenv("WORLD_SIZE", "2")
        s = T.main(config(tmp_path, folder))
    finally:
        if dist.is_initialized():  # main leaves the group when it ends
            dist.destroy_process_group()
    assert s["status"] == "ok" and s["world_size"] == 2
    assert (3,) in reduced and (5,) in reduced  # the epoch's and the evaluation's sums, at least


def test_the_package_and_its_muon_need_no_torch_optim_muon():
    """pyproject's torch floor is older than ``torch.optim.Muon`` (2.9): nothing may need it."""
    import subprocess
    import sys

    code = ("import torch; del torch.optim.Muon\n"
            "import vitattn\n"
            "from vitattn.training.optim import create_optimizer; from vitattn.tasks.classify.recipes import RECIPES\n"
            "m = vitattn.create_model('vit_quick', num_classes=3)\n"
            "opt = create_optimizer(m, **RECIPES['vit'].optimizer_kwargs())\n"
            "m(torch.randn(2, 3, 32, 32)).sum().backward(); opt.step(); print(type(opt.optimizers[0]).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "Muon", out.stderr


# -- the host waits for the GPU only when it must ----------------------------------------------


@pytest.mark.parametrize("model,kw", [("vit", dict(model_ema_decay=0.9, optimizer="adamw")), ("cnn", dict(cutout=4)),
                                      ("vit", dict(amp=True, amp_dtype="bfloat16", optimizer="muon"))],
                         ids=["vit-adamw-ema", "cnn-sgd-cutout", "vit-muon-bf16"])
def test_a_steady_state_step_moves_nothing_between_host_and_device(tmp_path, folder, stand_in, monkeypatch, model,
                                                                     kw):
    """Each copy or read between host and GPU makes the host wait for the GPU's queue: in steady
    state a step queues work and nothing else; the loop reads its sums every READ_EVERY steps."""
    if kw.get("amp"):  # autocast has no meta backend: the CPU's leaves meta ops as they are
        cpu_autocast = runtime.autocast  # the loop's, the one autocast a run has
        monkeypatch.setattr(runtime, "autocast", lambda device, dtype: cpu_autocast("cpu", dtype))
    monkeypatch.setattr(loop, "READ_EVERY", 4)
    per_step, step_of = [], []
    last = {"n": stand_in.traffic.total()}
    train_step = loop.train_step

    def counted(run, batch):  # the traffic since the previous step: one loop iteration's
        per_step.append(stand_in.traffic.total() - last["n"])
        step_of.append((run.state.global_step, run.state.step_in_epoch))
        n = train_step(run, batch)
        last["n"] = stand_in.traffic.total()
        return n

    monkeypatch.setattr(loop, "train_step", counted)
    s = T.main(config(tmp_path, folder, model=model, epochs=3, batch_size=6, **kw))
    assert s["status"] == "ok"
    # steady state: not an epoch's first step (evaluation and a checkpoint came before it), not a read's
    steady = [(step, n) for (step, in_epoch), n in zip(step_of, per_step) if step % loop.READ_EVERY and in_epoch]
    assert len(steady) >= 8 and all(n == 0 for _, n in steady), steady
    assert sum(per_step) > 0  # the reads every READ_EVERY steps are there, and counted


def test_the_stand_in_counts_copies_and_reads_and_checks_generators(stand_in):
    x = torch.zeros(4, device=STAND_IN)
    before = stand_in.traffic.total()
    y = torch.ones(4).to(STAND_IN)  # host -> device
    float(x.sum())  # a read
    x.cpu()  # device -> host
    assert stand_in.traffic.total() - before == 3 and y.device == STAND_IN
    with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
        torch.randint(0, 3, (4,), generator=torch.Generator(), device=STAND_IN)
    batches.translate_flip(torch.zeros(2, 3, 8, 8, dtype=torch.uint8, device=STAND_IN), 2, True,
                           runtime.step_generator(0, 1, device=STAND_IN))  # drawn on the device: accepted


# -- torch.cuda, NCCL and DDP as a GPU machine checks them -------------------------------------


@pytest.mark.parametrize("name,env,expect", [
    ("cuda", {}, 0), ("auto", {}, 0), ("cuda:1", {}, 1),
    ("cuda", dict(WORLD_SIZE="2", LOCAL_RANK="1"), 1), ("auto", dict(WORLD_SIZE="2", LOCAL_RANK="1"), 1)])
def test_every_cuda_device_gets_an_index_before_set_device(monkeypatch, name, env, expect):
    cuda = FakeCuda(count=2).install(monkeypatch)
    monkeypatch.setattr(runtime, "setup_distributed", lambda device: runtime.Dist())
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _, dev = runtime.place_process(name)
    assert dev == torch.device("cuda", expect) and cuda.set_calls == [expect]
    assert runtime.rng_states(dev)["cuda"][0] == expect  # the GPU's own random state, by index


@pytest.mark.parametrize("name,env,message", [
    ("cuda:0", dict(WORLD_SIZE="2", LOCAL_RANK="1"), "names one GPU for 2 processes"),
    ("cuda:2", {}, "has 2 CUDA device"), ("cuda", dict(WORLD_SIZE="4", LOCAL_RANK="3"), "has 2 CUDA device")])
def test_a_gpu_that_is_not_this_process_s_is_refused_in_one_line(monkeypatch, name, env, message):
    FakeCuda(count=2).install(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UsageError, match=message):
        runtime.place_process(name)


@pytest.mark.parametrize("name", ["cuda", "auto"])
def test_torchrun_ranks_each_take_their_own_gpu_for_nccl_and_ddp(monkeypatch, name):
    cuda = FakeCuda(count=2).install(monkeypatch)
    bound, wrapped = {}, []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", fake_ddp(cuda, wrapped))
    for rank in (0, 1):  # the two processes of a torchrun, one after the other
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setattr(dist, "init_process_group", fake_nccl(bound, rank))
        monkeypatch.setattr(dist, "get_rank", lambda r=rank: r)
        monkeypatch.setattr(dist, "get_world_size", lambda: 2)
        ranks, dev = runtime.place_process(name)
        runtime.wrap_model(torch.nn.Linear(2, 2), ranks, dev)
        assert (ranks.rank, ranks.local_rank, dev) == (rank, rank, torch.device("cuda", rank))
    assert bound == {0: 0, 1: 1} and wrapped == [0, 1]


def test_each_rank_resumes_its_own_random_streams(monkeypatch):
    cuda = FakeCuda(count=2).install(monkeypatch)
    model, opt = torch.nn.Linear(2, 2), None
    states = []
    for rank in (0, 1):  # what all_rng_states gathers from two ranks
        torch.manual_seed(100 + rank)
        states.append(runtime.rng_states(torch.device("cuda", rank)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": states}
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for rank in (0, 1):
        torch.manual_seed(0)
        assert checkpoint.restore(ck, model, opt, scaler, torch.device("cuda", rank), rank)
        assert torch.equal(torch.get_rng_state(), states[rank]["cpu"])
        assert torch.equal(cuda.states[rank], states[rank]["cuda"])
    assert not checkpoint.restore(ck, model, opt, scaler, torch.device("cpu"), 2)  # a third rank: seeded afresh


def test_on_cuda_adamw_and_sgd_take_their_fused_kernels_and_the_cpu_keeps_foreach():
    """Checked on fake CUDA tensors (FakeTensorMode makes them without a GPU): one fused kernel per
    step on a GPU; the CPU keeps the path its measurements and exact-resume tests were made on."""
    from dataclasses import replace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from vitattn.tasks.classify.recipes import RECIPES
    from vitattn.training.optim import create_optimizer

    def fused(model) -> dict[str, list]:
        opts = {o: create_optimizer(model, **replace(RECIPES["vit"], optimizer=o).optimizer_kwargs())
                for o in ("adamw", "sgd", "muon")}
        return {o: [x.defaults.get("fused") for x in getattr(opt, "optimizers", [opt])] for o, opt in opts.items()}

    model = registry.create_model("vit_quick")
    assert fused(model) == {"adamw": [None], "sgd": [None], "muon": [None, None]}
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = fused(model.to("cuda"))
    assert on_gpu == {"adamw": [True], "sgd": [True], "muon": [None, True]}  # Muon has no fused kernel


def test_gpu_settings_are_set_and_can_be_turned_off(monkeypatch):
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    try:
        runtime.configure_cuda()
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.benchmark
        runtime.configure_cuda(tf32=False, benchmark=False)
        assert not (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
        assert not torch.backends.cudnn.benchmark
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved
    cfg = T.parse_args(["--no-tf32", "--no-cudnn-benchmark"])
    assert (cfg.tf32, cfg.cudnn_benchmark) == (False, False)


def huge_pages_always() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[always]" in path.read_text()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc malloc setting")
@pytest.mark.skipif(huge_pages_always(), reason="counts 4 KiB page faults; huge pages fault 512 pages at once")
def test_kept_freed_memory_is_not_mapped_and_zeroed_anew_at_each_request():
    # a 64 MiB buffer asked for and freed ten times, as a training step's activations are: by
    # default glibc maps it anew each time and the kernel faults in (zeroes) every page again
    code = ("import resource, sys, torch\n"
            "from vitattn.training import runtime\n"
            "kept = runtime.keep_freed_memory() if sys.argv[1] == 'keep' else None\n"
            "torch.empty(16 << 20).fill_(1)\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for _ in range(10):\n"
            "    torch.empty(16 << 20).fill_(1)\n"
            "print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)")
    kept, faults = {}, {}
    for mode in ("keep", "system"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        kept[mode], faults[mode] = out.stdout.split()
    buffer_pages = (64 << 20) // resource.getpagesize()
    assert kept == {"keep": "True", "system": "None"}
    assert int(faults["system"]) > 5 * buffer_pages, faults
    # kept: the buffer faulted in twice at most, plus the few pages the interpreter touches besides
    # (one more was seen once the runtime module imported hashlib); not once per request
    assert int(faults["keep"]) <= 2 * buffer_pages + 64, faults
