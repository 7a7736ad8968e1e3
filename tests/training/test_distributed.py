"""Several processes, one run: 2 processes (gloo, started by torchrun or accelerate launch from
the test) with batch b each equal 1 process with batch 2b; a killed run resumes exactly."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from ktm import KTMError
from ktm.core.config import LoraSettings
from ktm.model import KTMModel, trainable_parameters
from ktm.tasks.tree import TreeTask
from ktm.training.config import TrainConfig
from ktm.training.distributed import World
from ktm.training.train import train

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
       "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", *args]


def accelerate(*args: str) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(port), *args]


def run(cmd: list[str], ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    if ok:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainable_parameters(model)}


def assert_same(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def steps_logged(out) -> list[int]:
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def start(tiny_model_dir, tmp_path_factory):
    return start_checkpoint(tiny_model_dir, tmp_path_factory)


def start_checkpoint(tiny_model_dir, tmp_path_factory) -> str:
    """A checkpoint with non-trivial LoRA and encoder weights and no dropout: both runs start
    from it, and nothing random happens in a step, so they can agree to 1e-5."""
    torch.manual_seed(0)
    model = KTMModel.from_base(tiny_model_dir, k=4, lora=LoraSettings(dropout=0.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in trainable_parameters(model):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    path = tmp_path_factory.mktemp("start") / "ck"
    model.save(str(path))
    return str(path)


@pytest.mark.slow  # launches 2 processes
def test_two_processes_with_batch_b_equal_one_with_2b(tiny_model_dir, start, tmp_path):
    """``ktm train`` under torchrun, unchanged: 2 x batch 2 == 1 x batch 4 after 3 steps, and
    so are the evaluations during training (``--eval-every``)."""
    from ktm.cli.main import main

    out = tmp_path / "two"
    flags = ["--model", tiny_model_dir, "--k", "4", "--init", start, "--task", "tree",
             "--stage", "small", "--n-train", "16", "--n-eval", "4", "--max-steps", "3",
             "--eval-every", "2", "--lr", "1e-2", "--no-progress"]
    run(torchrun("-m", "ktm.cli", "train", *flags, "--batch-size", "2", "--out-dir", str(out)))
    assert main(["train", *flags, "--batch-size", "4", "--out-dir", str(tmp_path / "one")]) == 0
    one = KTMModel.load(str(tmp_path / "one" / "checkpoint"), trainable=True)
    two = KTMModel.load(str(out / "checkpoint"), trainable=True)
    assert_same(trainable(two), trainable(one))
    before = trainable(KTMModel.load(start, trainable=True))
    assert any(not torch.equal(before[n], p) for n, p in trainable(one).items())  # it trained
    assert steps_logged(out) == [1, 2, 3]  # rank 0 alone wrote the metrics
    rows = [json.loads(r) for r in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    mine = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "eval" in r) for r in mine] == [(r["step"], "eval" in r) for r in rows]
    assert [r["step"] for r in mine if "eval" in r] == [2, 3]
    for a, b in zip(rows, mine):  # the logged loss covers the whole global window
        if "loss" in a:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        else:  # the same evaluation (its timings aside)
            same = {k for k in a["eval"] if not k.endswith("_s") and "_per_" not in k}
            assert same >= {"balanced_accuracy", "tokens_after"}
            assert {k: b["eval"][k] for k in same} == pytest.approx(
                {k: a["eval"][k] for k in same}, rel=1e-5)
    assert json.loads((out / "run.json").read_text())["processes"] == 2


@pytest.mark.slow  # launches 2 processes
@pytest.mark.parametrize("fault", ["rank 0 cannot write run.json", "missing --init"])
def test_an_error_ends_every_process_with_its_message(tiny_model_dir, start, tmp_path, fault):
    """An error raised on rank 0 alone (its write failed: the others go on to the first
    step's collectives) or on every process ends the run, naming the cause, not a hang."""
    out = tmp_path / "run"
    init = start
    if fault == "missing --init":
        init = str(tmp_path / "nowhere")
    else:
        (out / "run.json").mkdir(parents=True)  # rank 0's write of run.json fails
    r = subprocess.run(torchrun("-m", "ktm.cli", "train", "--model", tiny_model_dir, "--k", "4",
                                "--init", init, "--task", "tree", "--stage", "small",
                                "--n-train", "8", "--n-eval", "2", "--max-steps", "2",
                                "--batch-size", "2", "--out-dir", str(out), "--no-progress"),
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    expected = "cannot write" if fault.startswith("rank 0") else "nowhere"
    assert any(line.startswith("ktm: error:") and expected in line
               for line in r.stderr.splitlines()), r.stderr[-3000:]
    # the other process, which lost its peer, says so in one line: no backend traceback
    assert not [line for line in r.stderr.splitlines() if line.startswith("[rank")], r.stderr
    assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()


WORKER = textwrap.dedent("""
    import os, sys
    import torch
    from safetensors.torch import save_file
    from ktm.core.config import LoraSettings
    from ktm.model import KTMModel, trainable_parameters
    from ktm.tasks.tree import TreeTask
    from ktm.training.train import TrainConfig, train

    tiny, out, die_at, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    rank = int(os.environ["RANK"])
    torch.manual_seed(100 + rank)  # each process initialises differently: train() aligns them
    model = KTMModel.from_base(tiny, k=4, lora=LoraSettings(dropout=0.0))

    def on_step(step, _):
        if step == die_at and rank == 1:
            os.kill(os.getpid(), 9)  # killed mid-run, after the checkpoint of step 4

    data = TreeTask(stage="small").train_examples(16, seed=0)
    train(model, data, TrainConfig(out_dir=out, max_steps=6, batch_size=2, save_every=2,
                                   lr=1e-3, resume=resume, progress=False), on_step=on_step)
    save_file({n: p.detach().contiguous() for n, p in trainable_parameters(model)},
              os.path.join(out, f"rank{rank}.safetensors"))
""")


CPU_WORKER = textwrap.dedent("""
    import os, sys, time
    from ktm.core.config import LoraSettings
    from ktm.model import KTMModel
    from ktm.tasks.tree import TreeTask
    from ktm.training.train import TrainConfig, train

    tiny, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    model = KTMModel.from_base(tiny, k=4, lora=LoraSettings(dropout=0.0))
    data = TreeTask(stage="small").train_examples(8, seed=0)
    calls = []

    def cpu_seconds():  # the run starts at 0; then rank 0 has used 1 s, rank 1 2 s
        calls.append(1)
        return 0.0 if len(calls) == 1 else rank + 1.0

    time.process_time = cpu_seconds
    train(model, data, TrainConfig(out_dir=out, max_steps=2, batch_size=2, progress=False))
""")


@pytest.mark.slow  # launches 2 processes
def test_the_logged_cpu_seconds_are_those_of_every_process(tiny_model_dir, tmp_path):
    """cpu_s, the cost axis of ``ktm curves``, counted rank 0's CPU alone: a 2-process run
    looked half as costly as it was."""
    script = tmp_path / "worker.py"
    script.write_text(CPU_WORKER)
    run(torchrun(str(script), tiny_model_dir, str(tmp_path / "run")))
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["cpu_s"] for r in rows] == [3.0, 3.0]


@pytest.mark.slow  # launches 2 processes
def test_a_killed_two_process_run_resumes_exactly(tiny_model_dir, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "run"
    killed = run(torchrun(str(script), tiny_model_dir, str(out), "5", "0"), ok=False)
    assert killed.returncode != 0
    # rank 0, which lost rank 1, names the checkpoint a resume continues from
    assert "the checkpoint of step 4 in" in killed.stderr and "--resume" in killed.stderr
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["world_size"] == 2
    # resumed under the other launcher
    run(accelerate(str(script), tiny_model_dir, str(out), "0", "1"))
    ranks = [load_file(str(out / f"rank{r}.safetensors")) for r in (0, 1)]
    assert_same(ranks[0], ranks[1])  # both processes hold the same weights
    torch.manual_seed(100)  # rank 0's initial weights, which train() gave every process
    one = KTMModel.from_base(tiny_model_dir, k=4, lora=LoraSettings(dropout=0.0))
    train(one, TreeTask(stage="small").train_examples(16, seed=0),
          TrainConfig(out_dir=str(tmp_path / "one"), max_steps=6, batch_size=4, lr=1e-3,
                      progress=False))
    assert_same(ranks[0], {k: v for k, v in trainable(one).items()})
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]  # each step once, trimmed on resume
    # resuming on one process keeps the global batch of 4, or is refused
    with pytest.raises(KTMError, match=r"trained with processes=2, this run has processes=1;.*"
                                       r"must stay 4: here --batch-size 4"):
        train(KTMModel.from_base(tiny_model_dir, k=4, lora=LoraSettings(dropout=0.0)),
              TreeTask(stage="small").train_examples(16, seed=0),
              TrainConfig(out_dir=str(out), max_steps=8, batch_size=2, resume=True,
                          progress=False))
    one_more = KTMModel.from_base(tiny_model_dir, k=4, lora=LoraSettings(dropout=0.0))
    train(one_more, TreeTask(stage="small").train_examples(16, seed=0),
          TrainConfig(out_dir=str(out), max_steps=7, batch_size=4, lr=1e-3, resume=True,
                      progress=False))  # 1 process x batch 4 continues the 2 x 2 run
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.slow  # launches 2 processes
def test_pretrain_under_accelerate_launch(tiny_model_dir, start, tmp_path):
    """``ktm pretrain`` unchanged on 2 processes: the window stream covers both shards."""
    corpus = tmp_path / "texts"
    corpus.mkdir()
    text = "The quick brown fox jumps over the lazy dog. Hello world, my name is ktm. " * 8
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text(text[i * 7:])
    flags = ["--sources", str(corpus), "--objectives", "lm", "ae", "--context-tokens", "24",
             "--target-tokens", "8", "--ae-tokens", "16", "--min-tokens", "8", "--eval-sets",
             "none", "--max-steps", "2", "--lr", "1e-2", "--no-progress"]
    out = tmp_path / "two"
    run(accelerate("-m", "ktm.cli", "pretrain", "--model", tiny_model_dir, "--k", "4", "--init",
                   start, "--batch-size", "2", "--out-dir", str(out), *flags))
    from ktm.training.pretrain import PretrainConfig, pretrain

    one = KTMModel.load(start, trainable=True)
    pcfg = PretrainConfig(sources=(str(corpus),), objectives=("lm", "ae"), context_tokens=24,
                          target_tokens=8, ae_tokens=16, min_tokens=8, eval_sets=())
    pretrain(one, pcfg, TrainConfig(out_dir=str(tmp_path / "one"), max_steps=2, batch_size=4,
                                    lr=1e-2, progress=False))
    # two shards sum a step's gradients in another order than one process: on a Xeon with
    # AVX-512 the weights (up to 0.29) then differ by up to 1.7e-5 after two Adam steps at 1e-2;
    # a lost or doubled window moves them by the order of the learning rate
    assert_same(trainable(KTMModel.load(str(out / "checkpoint"), trainable=True)), trainable(one),
                atol=1e-4)


def test_world_shards_and_single_process_helpers():
    assert list(World(0, 2).shard(6)) == [0, 1, 2] and list(World(1, 2).shard(6)) == [3, 4, 5]
    assert list(World().shard(5)) == [0, 1, 2, 3, 4]
    with pytest.raises(KTMError, match="5 items cannot be split evenly over 2"):
        World(1, 2).shard(5)


def test_a_resume_on_processes_that_cannot_split_the_global_batch_names_the_sizes():
    """1 process x batch 3 continued by 2 processes: no --batch-size fits; say why."""
    from ktm.training.state import check_resume

    saved = {"config": {"seed": 0, "batch_size": 3, "grad_accum": 1}, "world_size": 1}
    with pytest.raises(KTMError, match=r"processes=1, this run has processes=2;.* must stay 3, "
                                       r"which 2 processes x grad_accum 1 = 2 does not divide"):
        check_resume(saved, TrainConfig(batch_size=3), {"n_examples": 16}, "ck", processes=2)


def test_no_launcher_means_one_process(monkeypatch):
    from ktm.training import distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.setup("cpu") == World()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(KTMError, match="WORLD_SIZE='two' is not an integer"):
        distributed.setup("cpu")



def test_a_launched_process_refuses_another_processs_gpu(monkeypatch):
    """Under a launcher each process uses cuda:LOCAL_RANK; --device cuda:0 would put every
    process's model on GPU 0, which NCCL refuses obscurely (or every collective hangs)."""
    import torch.distributed as dist

    from ktm.training import distributed

    def no_group(*args, **kwargs):
        raise AssertionError("joined a process group with the wrong device")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", no_group)
    with pytest.raises(KTMError, match=r"'cuda:0' under a launcher: each process uses "
                                       r"cuda:LOCAL_RANK \(this one cuda:1\); expected --device"):
        distributed.setup("cuda:0")


def joined_with(monkeypatch) -> dict:
    """``distributed.setup`` on a fake 2-process launch: the keyword arguments it joins with."""
    import torch.distributed as dist

    from ktm.training import distributed

    seen: dict = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    monkeypatch.setattr(distributed, "current", lambda: World(0, 2))
    distributed.setup("cpu")
    return seen


def test_the_processes_wait_long_enough_for_rank_0s_evaluation(monkeypatch):
    """Rank 0 evaluates while the others wait in the next collective: the backends' default
    timeouts (NCCL 10 min, gloo 30) aborted them during a long evaluation."""
    from datetime import timedelta

    monkeypatch.delenv("KTM_DIST_TIMEOUT", raising=False)
    assert joined_with(monkeypatch)["timeout"] == timedelta(minutes=120)
    monkeypatch.setenv("KTM_DIST_TIMEOUT", "7.5")
    assert joined_with(monkeypatch)["timeout"] == timedelta(minutes=7.5)
    for bad in ["soon", "0", "-3", "inf", "nan"]:
        monkeypatch.setenv("KTM_DIST_TIMEOUT", bad)
        with pytest.raises(KTMError, match=rf"KTM_DIST_TIMEOUT='{bad}': expected a number of "
                                           r"minutes > 0"):
            joined_with(monkeypatch)


def test_a_lost_peer_is_one_line_with_exit_code_1(monkeypatch, capsys):
    """A process whose collective fails because another one ended printed the backend's
    traceback over the failing process's own ``ktm: error:`` line."""
    import torch.distributed as dist

    import ktm.cli.train as cli_train
    from ktm.cli.main import main
    from ktm.training import distributed

    def closed(t):
        raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                           "Connection closed by peer [127.0.0.1]:5. This is typically caused "
                           "by a remote worker crashing.\nmore")

    monkeypatch.setattr(dist, "all_reduce", closed)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    with pytest.raises(distributed.PeerLost, match=r"^process 1 of 2 lost the others "
                                                   r"\(Connection closed by peer "
                                                   r"\[127.0.0.1\]:5\): another process ended"):
        distributed.sum_numbers([1.0], World(1, 2), torch.device("cpu"))

    def lost(args):
        distributed.sum_numbers([1.0], World(1, 2), torch.device("cpu"))

    monkeypatch.setattr(cli_train, "cmd_train", lost)
    assert main(["train", "--task", "tree"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("ktm: error: process 1 of 2 lost the others")


RESUME_CPU_WORKER = textwrap.dedent("""
    import json, os, sys, time
    from ktm.core.config import LoraSettings
    from ktm.model import KTMModel
    from ktm.tasks.tree import TreeTask
    from ktm.training.train import TrainConfig, train

    tiny, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    loop = sys.modules["ktm.training.train"]  # the module (ktm.training.train is also the function)
    trim = loop.trim_metrics

    def slow_trim(*args):  # rank 1 reaches its read of metrics.jsonl before rank 0 trims it
        time.sleep(2)
        trim(*args)

    loop.trim_metrics = slow_trim
    model = KTMModel.from_base(tiny, k=4, lora=LoraSettings(dropout=0.0))
    last = train(model, TreeTask(stage="small").train_examples(16, seed=0),
                 TrainConfig(out_dir=out, max_steps=3, batch_size=2, resume=True,
                             progress=False))
    with open(os.path.join(out, f"cpu{rank}.json"), "w") as f:
        json.dump(last["cpu_s"], f)
""")


@pytest.mark.slow  # launches 2 processes
def test_a_resumed_run_returns_the_same_cpu_seconds_on_every_process(tiny_model_dir, tmp_path):
    """On resume every process continued the CPU count from the last row of metrics.jsonl, but
    only rank 0 trims the rows a killed run logged after its checkpoint: rank 1 could read
    an untrimmed row and return other metrics than rank 0's."""
    out = tmp_path / "run"
    train(KTMModel.from_base(tiny_model_dir, k=4, lora=LoraSettings(dropout=0.0)),
          TreeTask(stage="small").train_examples(16, seed=0),
          TrainConfig(out_dir=str(out), max_steps=2, batch_size=4, progress=False))
    with (out / "metrics.jsonl").open("a") as f:  # logged by a run killed before its next save
        f.write(json.dumps({"step": 3, "loss": 1.0, "cpu_s": 999.0}) + "\n")
    script = tmp_path / "worker.py"
    script.write_text(RESUME_CPU_WORKER)
    run(torchrun(str(script), tiny_model_dir, str(out)))
    cpu = [json.loads((out / f"cpu{r}.json").read_text()) for r in (0, 1)]
    assert cpu[0] == cpu[1] < 999.0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["cpu_s"] == cpu[0]


HELDOUT_WORKER = textwrap.dedent("""
    import os, sys
    import ktm.tasks.corpus, ktm.evaluation.readability
    from ktm.model import KTMModel
    from ktm.training.pretrain import PretrainConfig, pretrain
    from ktm.training.train import TrainConfig

    start, corpus, out, mode = sys.argv[1:5]
    rank = int(os.environ["RANK"])
    read = ktm.evaluation.readability.heldout_windows

    def counted(*args, **kw):
        open(os.path.join(out, f"read{rank}"), "a").close()
        return read(*args, **kw)

    ktm.evaluation.readability.heldout_windows = counted
    if mode == "ok":  # held-out text without the data folder: long enough for R's windows
        ktm.tasks.corpus.heldout_texts = lambda name: ["the quick brown fox " * 200] * 2
    os.makedirs(out, exist_ok=True)
    cfg = PretrainConfig(sources=(corpus,), objectives=("lm",), context_tokens=24,
                         target_tokens=8, min_tokens=8, eval_sets=("reviews",),
                         n_eval_windows=1)
    try:
        pretrain(KTMModel.load(start, trainable=True), cfg,
                 TrainConfig(out_dir=os.path.join(out, "run"), max_steps=1, batch_size=1,
                             progress=False))
    except Exception as e:
        with open(os.path.join(out, f"error{rank}"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
""")


@pytest.mark.slow  # launches 2 processes, twice
def test_pretrain_reads_the_held_out_sets_on_rank_0_alone(start, tmp_path):
    """Only rank 0 evaluates, but every process read and tokenised the held-out sets; a set
    that cannot be read still stops every process before training, naming the cause."""
    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "doc.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    script = tmp_path / "worker.py"
    script.write_text(HELDOUT_WORKER)
    ok, bad = tmp_path / "ok", tmp_path / "bad"
    run(torchrun(str(script), start, str(corpus), str(ok), "ok"))
    assert sorted(p.name for p in ok.iterdir() if p.name != "run") == ["read0"]
    rows = [json.loads(r) for r in (ok / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "reviews" in rows[-1]["eval"]  # rank 0 evaluated on what it read
    cmd = torchrun(str(script), start, str(corpus), str(bad), "bad")
    r = subprocess.run(cmd, env={**ENV, "KTM_DATA": str(tmp_path / "no-data")},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    errors = [(bad / f"error{rank}").read_text() for rank in (0, 1)]
    assert errors[0].startswith("KTMError: data file not found"), errors
    assert errors[1].startswith("PeerLost: process 1 of 2: rank 0 failed (KTMError: data "
                                "file not found"), errors
    assert not (bad / "read1").exists() and not (bad / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("command", [["eval", "--task", "tree"], ["report", "nowhere"],
                                     ["generate", "--prompt", "hi"]])
def test_a_one_process_command_under_a_launcher_is_refused(command, monkeypatch, capsys):
    """``torchrun ... -m ktm.cli eval`` ran the whole evaluation on every process, printed
    its result once per process and wrote --json / --predictions over each other."""
    from ktm.cli.main import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(command) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ktm: error: ktm {command[0]} runs in one process, but a launcher started "
        "WORLD_SIZE=2 of them: run it without torchrun / accelerate launch (only train, "
        "pretrain, curriculum run on several)"]


EVAL_SET_WORKER = textwrap.dedent("""
    import os, sys
    from ktm.cli.main import main
    from ktm.tasks.tree import TreeTask

    rank, real = int(os.environ["RANK"]), TreeTask.eval_examples

    def eval_examples(self, n, seed=0):
        open(os.path.join(sys.argv[-1], f"eval{rank}"), "a").close()
        return real(self, n, seed=seed)

    TreeTask.eval_examples = eval_examples
    sys.exit(main(sys.argv[1:-1]))
""")


@pytest.mark.slow  # launches 2 processes
def test_train_builds_and_compresses_its_eval_set_on_rank_0_alone(tiny_model_dir, start,
                                                                   tmp_path):
    """Only rank 0 evaluates during training, but every process read the eval set and, with a
    --compressor, compressed it (for llmlingua a scorer LM over every prompt)."""
    script = tmp_path / "worker.py"
    script.write_text(EVAL_SET_WORKER)
    out = tmp_path / "run"
    run(torchrun(str(script), "train", "--model", tiny_model_dir, "--k", "4", "--init", start,
                 "--task", "tree", "--stage", "small", "--n-train", "8", "--n-eval", "4",
                 "--max-steps", "1", "--batch-size", "2", "--compressor", "ltsc",
                 "--out-dir", str(out), "--no-progress", str(tmp_path)))
    assert sorted(p.name for p in tmp_path.glob("eval*")) == ["eval0"]
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval"]["n"] == 4 and rows[-1]["eval"]["tokens_before"] > 0
