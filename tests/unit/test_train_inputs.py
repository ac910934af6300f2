"""`paraseek train` input checks: every mistake in a flag or a TOML value (type, choice, range, unknown name, an
output path that cannot be written -- tried with a probe file, so /proc and /sys are refused to root too --, a file
that is not what it claims, a flag that cannot act in the run, a sequence longer than the model's positions, a
tokenizer that is not the model's) costs exit code 2 and one line, before anything is launched; --print-config
shows the merged configuration; --init-from's tokenizer is the one used and the first log line names it; --slurm's
script."""

import json
import os
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from paraseek.cli import main
from paraseek.models import preset_config
from paraseek.train import launch
from paraseek.train.config import TrainConfig, resolve_defaults, tokenizer_origin
from paraseek.train.dataset import open_dataset
from paraseek.models.tokenizer import BUNDLED_TOKENIZER
from paraseek.train.loop import data_line
from paraseek.train.multinode import ONE_HOST_ENV, check_endpoint, route_interface

# Every case runs with these flags unless it names the key itself (flag or TOML).
BASE = {"device": "cpu", "model": "tiny-dense", "nproc": "1", "seq_len": "16", "steps": "2", "global_batch_size": "2"}
D = "doc.txt"  # a small text corpus in the work folder
TWO_NODES = ["--nnodes", "2", "--rdzv-endpoint"]

# (argv, TOML text or None, extra environment or None, what the one line must say)
MISTAKES = {
    # types
    "lr not a number": (["--lr", "abc"], None, None, "argument --lr: invalid float value: 'abc'"),
    "steps a float": (["--steps", "1.5"], None, None, "argument --steps: invalid int value: '1.5'"),
    "nproc a word": (["--nproc", "two"], None, None, "argument --nproc: invalid int value: 'two'"),
    "bool not a bool": (["--cpu-offload", "2"], None, None, "expected true or false, got '2'"),
    "lr nan": (["--lr", "nan"], None, None, "--lr must be a finite number, got nan"),
    "lr inf": (["--lr", "inf"], None, None, "--lr must be a finite number, got inf"),
    "comm-timeout inf": (["--comm-timeout", "inf"], None, None, "--comm-timeout must be a finite number"),
    "negative in e-notation": (["--lr", "-1e-3"], None, None, "is written --flag=VALUE"),
    "toml steps a string": ([], 'steps = "10"\n', None, "steps in c.toml must be an integer, got '10'"),
    "toml lr a string": ([], 'lr = "3e-4"\n', None, "lr in c.toml must be a number, got '3e-4'"),
    "toml bool a string": ([], 'compile = "yes"\n', None, "compile in c.toml must be true or false, got 'yes'"),
    "toml bool an int": ([], "compile = 1\n", None, "compile in c.toml must be true or false, got 1"),
    "toml int a bool": ([], "steps = true\n", None, "steps in c.toml must be an integer, got True"),
    "toml seq_len a float": ([], "seq_len = 12.5\n", None, "seq_len in c.toml must be an integer, got 12.5"),
    "toml model a list": ([], 'model = ["tiny-dense"]\n', None, "model in c.toml must be a string"),
    # choices
    "precision fp8": (["--precision", "fp8"], None, None, "--precision must be one of fp32, bf16, fp16, got 'fp8'"),
    "toml precision fp8": ([], 'precision = "fp8"\n', None, "precision in c.toml must be one of fp32, bf16, fp16"),
    "device tpu": (["--device", "tpu"], None, None, "--device must be one of cpu, cuda"),
    "lr-schedule typo": (["--lr-schedule", "cosin"], None, None, "got 'cosin' (did you mean cosine?)"),
    "toml lr_schedule case": ([], 'lr_schedule = "Cosine"\n', None, "(did you mean cosine?)"),
    "checkpointing partial": (["--activation-checkpointing", "partial"], None, None, "must be one of none, full"),
    "on-anomaly ignore": (["--on-anomaly", "ignore"], None, None, "--on-anomaly must be one of warn, skip, stop"),
    "plan best": (["--plan", "best"], None, None, "--plan must be one of auto"),
    "pp-schedule case, unused": (["--pp-schedule", "1f1b"], None, None, "(did you mean 1F1B?)"),
    "grad-compression int8": (["--grad-compression", "int8", "--nproc", "2", "--dp-replicate", "2", "--dp-shard",
                               "1"], None, None, "--grad-compression 'int8': expected none, bf16 or powersgd:RANK"),
    "powersgd rank 0": (["--grad-compression", "powersgd:0", "--nproc", "2", "--dp-replicate", "2", "--dp-shard",
                         "1"], None, None, "expected none, bf16 or powersgd:RANK"),
    # ranges
    "lr negative": (["--lr=-0.001"], None, None, "--lr must be >= 0, got -0.001"),
    "weight decay negative": (["--weight-decay", "-0.1"], None, None, "--weight-decay must be >= 0, got -0.1"),
    "toml weight_decay negative": ([], "weight_decay = -1.0\n", None, "weight_decay in c.toml must be >= 0"),
    "comm-timeout negative": (["--comm-timeout", "-5"], None, None, "--comm-timeout must be >= 0, got -5.0"),
    "rdzv-timeout negative": (["--rdzv-timeout", "-1"], None, None, "--rdzv-timeout must be >= 1, got -1.0"),
    "log-every 0": (["--log-every", "0"], None, None, "--log-every must be >= 1, got 0"),
    "checkpoint-every negative": (["--checkpoint-every", "-10", "--checkpoint-dir", "ck"], None, None,
                                  "--checkpoint-every must be >= 0, got -10"),
    "nproc negative": (["--nproc", "-1"], None, None, "--nproc must be >= 0, got -1"),
    "toml nproc negative": ([], "nproc = -2\n", None, "nproc in c.toml must be >= 0, got -2"),
    "nnodes 0": (["--nnodes", "0"], None, None, "--nnodes must be >= 1, got 0"),
    "node-rank negative": (["--node-rank", "-1"], None, None, "--node-rank must be >= 0, got -1"),
    "node-rank past the nodes": ([*TWO_NODES, "10.1.2.3:29500", "--node-rank", "2"], None, None,
                                 "--node-rank 2 with --nnodes 2: node ranks are 0 to 1"),
    "node-rank on one node": (["--node-rank", "1"], None, None, "--node-rank 1 with --nnodes 1"),
    "steps 0": (["--steps", "0"], None, None, "--steps must be >= 1, got 0"),
    "warmup negative": (["--warmup-steps", "-1"], None, None, "--warmup-steps must be >= 0"),
    "min-lr-ratio above 1": (["--min-lr-ratio", "1.5"], None, None, "--min-lr-ratio must be between 0 and 1"),
    "grad-clip negative": (["--grad-clip", "-1"], None, None, "--grad-clip must be >= 0"),
    "seed negative": (["--seed", "-1"], None, None, "--seed must be >= 0"),
    "micro-batch 0": (["--micro-batch-size", "0"], None, None, "--micro-batch-size must be >= 1"),
    "global batch negative": (["--global-batch-size", "-8"], None, None, "--global-batch-size must be >= 1"),
    "loss-chunks negative": (["--loss-chunks", "-2"], None, None, "--loss-chunks must be >= 0"),
    "moe-bias-gamma negative": (["--moe-bias-gamma", "-0.5"], None, None, "must be >= 0 (or -1: the default)"),
    "pp-virtual-stages negative": (["--pp-virtual-stages", "-1"], None, None, "--pp-virtual-stages must be >= 0"),
    # the degrees: ParallelDims' rule set, each named as itself
    "tp 0": (["--tp", "0"], None, None, "--tp must be positive, got 0"),
    "dp-shard 0": (["--dp-shard", "0"], None, None, "--dp-shard must be positive, got 0"),
    "dp-shard cannot fill": (["--nproc", "4", "--dp-replicate", "3"], None, None,
                             "4 processes are not divisible by --dp-replicate 3 x --tp 1 x --pp 1"),
    "degrees off": (["--nproc", "4", "--dp-replicate", "3", "--dp-shard", "2"], None, None, "world size is 4"),
    # the model
    "seq longer than positions": (["--seq-len", "4096"], None, None,
                                  "--seq-len 4096 is longer than tiny-dense's 512 positions"),
    "model and init-from differ": (["--model", "tiny-moe", "--init-from", "small"], None, None,
                                   "--model tiny-moe and --init-from small are different models"),
    "init-from without config.json": (["--init-from", "nonempty"], None, None, "not an HF folder (no config.json)"),
    "init-from a config.json that is a picture": (["--init-from", "picture"], None, None,
                                                  "picture/config.json: not valid JSON (not UTF-8 text"),
    # unknown names, with did-you-mean
    "flag misspelt": (["--seqlen", "128"], None, None, "unknown flag --seqlen (did you mean --seq-len?)"),
    "flag from another trainer": (["--learning-rate", "0.1"], None, None, "unknown flag --learning-rate (did you mean "
                                                                            "--lr?)"),
    "flag batch-size": (["--batch-size", "8"], None, None, "(did you mean --global-batch-size?)"),
    "flag with =": (["--max-steps=10"], None, None, "unknown flag --max-steps (did you mean --steps?)"),
    "stray word": (["tiny-moe"], None, None, "unexpected argument 'tiny-moe'"),
    "toml key misspelt": ([], "stepz = 3\n", None, "unknown key 'stepz' (did you mean steps?)"),
    "toml key from another trainer": ([], "learning_rate = 0.1\n", None, "unknown key 'learning_rate' (did you "
                                                                         "mean lr?)"),
    "toml table": ([], "[train]\nsteps = 3\n", None, "unknown key 'train'"),
    "toml not toml": ([], "steps = = 3\n", None, "not valid TOML"),
    "toml a binary file": (["--config", "picture.toml"], None, None, "--config picture.toml: not valid TOML (not "
                                                                      "UTF-8 text"),
    "flag by another name": (["--sequence-length", "128"], None, None, "(did you mean --seq-len?)"),
    "toml key by another name": ([], "max_sequence_length = 128\n", None, "(did you mean seq_len?)"),
    "config missing": (["--config", "nope.toml"], None, None, "--config nope.toml: no such file"),
    # output paths
    "checkpoint-dir under a file": (["--checkpoint-dir", "afile/ck"], None, None, "afile is a file, so no folder"),
    "checkpoint-dir is a file": (["--checkpoint-dir", "afile"], None, None, "--checkpoint-dir afile: that is a file"),
    "export-hf under a file": (["--export-hf", "afile/out"], None, None, "--export-hf afile/out:"),
    "metrics-jsonl is a folder": (["--metrics-jsonl", "dir.jsonl"], None, None, "that is a folder; give a file"),
    "metrics-jsonl under a file": (["--metrics-jsonl", "afile/m.jsonl"], None, None, "--metrics-jsonl afile/m.jsonl"),
    "run-dir under a file": (["--run-dir", "afile/run"], None, None, "--run-dir afile/run:"),
    "tensorboard is a file": (["--tensorboard", "afile"], None, None, "--tensorboard afile: that is a file"),
    "token cache under a file": (["--data", D], None, {"PARASEEK_CACHE": "afile/c"},
                                 "the token cache ($PARASEEK_CACHE)"),
    "output not writable": (["--checkpoint-dir", "readonly/ck"], None, None, "cannot be written (permission denied)"),
    "checkpoint-dir on /proc": (["--checkpoint-dir", "/proc/paraseek-ck"], None, None,
                                "--checkpoint-dir /proc/paraseek-ck: /proc cannot be written"),
    "tensorboard on /sys": (["--tensorboard", "/sys/paraseek-tb"], None, None, "/sys cannot be written"),
    "metrics-jsonl on /proc": (["--metrics-jsonl", "/proc/x/m.jsonl"], None, None, "/proc cannot be written"),
    "token cache on /proc": (["--data", D], None, {"PARASEEK_CACHE": "/proc/c"}, "the token cache ($PARASEEK_CACHE) "
                                                                                "/proc/c/tokens: /proc cannot be"),
    # data and tokenizer
    "tokenizer larger than the model's vocab": (["--model", "small", "--data", D], None, None,
                                                "the bundled tokenizer.json has 2,048 tokens but the model's "
                                                "vocab_size is 1,000"),
    "init-from's tokenizer larger": (["--init-from", "small_with_tok", "--data", D], None, None,
                                     "--init-from's small_with_tok/tokenizer.json has 2,048 tokens"),
    "tokenizer missing": (["--tokenizer", "nope.json", "--data", D], None, None, "--tokenizer nope.json: no tokenizer"),
    "tokenizer not json": (["--tokenizer", "bad.json", "--data", D], None, None, "not a valid HF tokenizer.json"),
    "tokenizer unused": (["--tokenizer", "tok.json"], None, None, "--tokenizer tok.json with --data synthetic"),
    "data missing": (["--data", "no/such.txt"], None, None, "no such file or folder"),
    "data of another type": (["--data", "afile"], None, None, "unsupported file type"),
    # combinations
    "checkpoint-every without a folder": (["--checkpoint-every", "10"], None, None, "needs --checkpoint-dir"),
    "resume without a folder": (["--resume"], None, None, "--resume needs --checkpoint-dir"),
    "hardware missing": (["--hardware", "nope.json"], None, None, "--hardware nope.json: no such file"),
    "batch indivisible": (["--nproc", "2", "--global-batch-size", "3"], None, None, "not divisible"),
    "cpu-offload on cpu": (["--cpu-offload"], None, None, "nothing to offload"),
    "fp16 on cpu": (["--precision", "fp16"], None, None, "--precision fp16 is for GPUs"),
    "profile-steps junk": (["--profile-steps", "five"], None, None, "--profile-steps 'five': expected A:B"),
    "profile-steps past the run": (["--profile-steps", "2:3"], None, None, "--profile-steps 2:3: this run trains "
                                                                           "steps 1-2, so that window would never"),
    # flags that act only with another kind of parallelism
    "sequence-parallel without tp": (["--sequence-parallel", "false"], None, None,
                                     "--sequence-parallel false acts only with --tp N"),
    "sequence-parallel without tp, in TOML": ([], "sequence_parallel = false\n", None, "acts only with --tp N"),
    "pp-schedule without pp": (["--pp-schedule", "GPipe"], None, None, "--pp-schedule GPipe acts only with --pp N"),
    "pp-virtual-stages without pp": (["--pp-virtual-stages", "2"], None, None, "--pp-virtual-stages 2 acts only"),
    "inject-fault junk": (["--inject-fault", "boom"], None, None, "--inject-fault 'boom'"),
    # nodes
    "nnodes without endpoint": (["--nnodes", "2"], None, None, "--nnodes > 1 needs --rdzv-endpoint"),
    "endpoint without port": ([*TWO_NODES, "node0"], None, None, "expected HOST:PORT"),
    "endpoint port too large": ([*TWO_NODES, "10.1.2.3:99999"], None, None, "a port from 1 to 65535"),
    "endpoint localhost": ([*TWO_NODES, "localhost:29500"], None, None, "resolves to the loopback address"),
    "endpoint unknown host": ([*TWO_NODES, "no-such-host.invalid:29500"], None, None, "does not resolve"),
    "endpoint on one node": (["--rdzv-endpoint", "10.1.2.3:29500"], None, None, "is for multi-node runs"),
    "slurm without nnodes": (["--slurm", "--nproc", "8", "--checkpoint-dir", "ck"], None, None,
                             "--slurm writes a multi-node job"),
    "slurm without checkpoints": (["--slurm", "--nnodes", "2", "--nproc", "8"], None, None, "give --checkpoint-dir"),
}
GOOD = {
    "the base flags": [],
    "an int for a float in TOML": ["--config", "lr.toml"],
    "text data": ["--data", D],
    "--model agreeing with --init-from": ["--model", "tiny-dense", "--init-from", "dense"],
    "--model with --init-from its export (the tokenizer's bos/eos)": ["--model", "tiny-dense", "--init-from",
                                                                       "exported"],
    "--sequence-parallel false with --tp": ["--nproc", "2", "--tp", "2", "--sequence-parallel", "false"],
    "--profile-steps inside the run": ["--profile-steps", "1:2"],
    "a bare bool flag and dashes in TOML": ["--compile", "--config", "dashes.toml"],
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding what the cases point at: a file, a corpus, models with and without a tokenizer."""
    w = tmp_path_factory.mktemp("inputs")
    (w / "afile").write_text("x")
    (w / D).write_text("A small corpus, tokenized once into the cache. " * 100)
    (w / "nonempty").mkdir()
    (w / "nonempty" / "x").write_text("x")
    (w / "dir.jsonl").mkdir()
    (w / "bad.json").write_text("{not json")
    shutil.copy(BUNDLED_TOKENIZER, w / "tok.json")
    (w / "picture.toml").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    for name, vocab, tok in (("small", 1000, False), ("small_with_tok", 1000, True), ("dense", 2048, True),
                             ("exported", 2048, True), ("picture", 2048, False)):
        (w / name).mkdir()
        # exported: as paraseek writes it, the bos/eos ids of the tokenizer it trained with (the bundled one: 0, 1)
        ids = {"bos_token_id": 0, "eos_token_id": 1} if name == "exported" else {}
        (w / name / "config.json").write_text(json.dumps(dict(preset_config("tiny-dense"), vocab_size=vocab, **ids)))
        if tok:
            shutil.copy(BUNDLED_TOKENIZER, w / name / "tokenizer.json")
        save_file({"unused": torch.zeros(1)}, w / name / "model.safetensors")  # --init-from needs weights
    (w / "lr.toml").write_text("lr = 1\n")
    (w / "dashes.toml").write_text('lr-schedule = "linear"\nwarmup-steps = 1\n')
    (w / "picture" / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    (w / "readonly").mkdir()
    os.chmod(w / "readonly", 0o500)
    return w


def attempt(argv, workdir, monkeypatch, capsys, toml=None, env=None, base=True):
    """(exit code, stderr, stdout, launched configs) of `paraseek train BASE... argv` in the work folder."""
    keys = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    if toml is not None:
        keys |= {k.replace("-", "_") for k in _toml_keys(toml)}
        (workdir / "c.toml").write_text(toml)
        argv = ["--config", "c.toml", *argv]
    if "init_from" in keys:
        keys.add("model")  # --init-from names the model
    base = [x for k, v in BASE.items() if base and k not in keys for x in ("--" + k.replace("_", "-"), v)]
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("PARASEEK_CACHE", str(workdir / "cache"))
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    launched = []
    monkeypatch.setattr(launch, "launch", lambda cfg: launched.append(cfg) or 0)
    capsys.readouterr()
    try:
        rc = main(["train", *base, *argv])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.err, out.out, launched


def _toml_keys(text):
    try:
        return tomllib.loads(text).keys()
    except tomllib.TOMLDecodeError:
        return ()


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_every_mistake_is_one_line_before_launch(case, workdir, monkeypatch, capsys):
    argv, toml, env, message = MISTAKES[case]
    if case == "output not writable" and os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    rc, err, out, launched = attempt(argv, workdir, monkeypatch, capsys, toml, env)
    lines = err.strip().splitlines()
    assert rc == 2 and not launched, (rc, err)
    assert len(lines) == 1 and message in lines[0], err
    assert "usage:" not in err + out and "Traceback" not in err


@pytest.mark.parametrize("case", sorted(GOOD))
def test_good_input_is_launched(case, workdir, monkeypatch, capsys):
    rc, err, _, launched = attempt(GOOD[case], workdir, monkeypatch, capsys)
    assert rc == 0 and len(launched) == 1, err


def test_print_config_is_the_merged_configuration(workdir, monkeypatch, capsys):
    """TOML, then flags, then this machine's defaults, printed as TOML that --config reads back unchanged."""
    (workdir / "run.toml").write_text('steps = 7\nlr = 0.01\ndata = "doc.txt"\nmetrics-jsonl = "out/m.jsonl"\n')
    rc, err, out, launched = attempt(["--config", "run.toml", "--steps", "9", "--init-from", "dense",
                                      "--print-config"], workdir, monkeypatch, capsys)
    assert rc == 0 and not launched, err
    printed = tomllib.loads(out)
    assert set(printed) == set(TrainConfig.__dataclass_fields__)
    assert (printed["steps"], printed["lr"], printed["seq_len"]) == (9, 0.01, 16)  # flag over TOML, TOML, flag
    assert (printed["precision"], printed["nproc"], printed["dp_shard"]) == ("fp32", 1, 1)  # this machine's
    assert printed["run_dir"] == "out" and printed["tokenizer"] == printed["model"] == "dense"  # --init-from's
    (workdir / "printed.toml").write_text(out)
    rc, _, again, _ = attempt(["--config", "printed.toml", "--print-config"], workdir, monkeypatch, capsys, base=False)
    assert rc == 0 and again == out


def test_init_from_tokenizer_is_used_and_named(workdir):
    def resolved(**kw):
        return resolve_defaults(TrainConfig(device="cpu", nproc=1, **kw), False, 0)

    own = resolved(init_from=str(workdir / "dense"), data=str(workdir / D))
    assert own.tokenizer == str(workdir / "dense") and tokenizer_origin(own).startswith("--init-from's")
    assert resolved(init_from=str(workdir / "small"), data=D).tokenizer == str(BUNDLED_TOKENIZER)  # it has none
    assert resolved(init_from=str(workdir / "dense"), data=D, tokenizer="tok.json").tokenizer == "tok.json"
    assert resolved(init_from=str(workdir / "dense")).tokenizer == ""  # synthetic data is not tokenized

    cfg = TrainConfig(**{**own.__dict__, "seq_len": 16, "steps": 10, "global_batch_size": 4})
    ds = open_dataset(cfg.data, seq_len=16, vocab_size=2048, tokenizer=cfg.tokenizer)
    line = data_line(cfg, ds)
    assert line.startswith(f"data: {workdir / D} | tokenizer: --init-from's {workdir / 'dense' / 'tokenizer.json'} "
                           "(2,048 tokens) | ")
    n = len(ds.tokens) // 17
    assert f"{len(ds.tokens):,} tokens = {n:,} sequences of 16 + 1" in line
    assert line.endswith(f"10 steps x 4 sequences = {40 / n:.2f} epochs")
    synthetic = data_line(TrainConfig(seq_len=16, steps=3, global_batch_size=2),
                          open_dataset("synthetic", seq_len=16, vocab_size=2048))
    assert synthetic.startswith("data: synthetic (random token ids below vocab_size 2,048; no tokenizer)")


def test_endpoint_rules(monkeypatch):
    monkeypatch.delenv(ONE_HOST_ENV, raising=False)
    assert check_endpoint("10.1.2.3:29500") == "10.1.2.3"
    with pytest.raises(Exception, match="loopback"):
        check_endpoint("127.0.0.1:29500")
    monkeypatch.setenv(ONE_HOST_ENV, "1")  # every node's launcher on this machine: the tests' case
    assert check_endpoint("127.0.0.1:29500") == "127.0.0.1"
    assert route_interface("127.0.0.1", 29500) == ("lo", "127.0.0.1")


def test_other_commands_also_answer_in_one_line(capsys):
    for argv in (["info"], ["info", "tiny-moe", "--seq-len", "x"], ["export", "a", "b", "--dtpe", "float32"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "usage:" not in err, err


def test_slurm_script(workdir, monkeypatch, capsys, tmp_path):
    """The script: one launcher per node, node 0 from scontrol, the socket interfaces, requeue + --resume; valid
    bash; and run with stand-ins for srun and scontrol, a SIGUSR1 (time limit near) stops the step and requeues."""
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    rc, err, script, launched = attempt(["--slurm", "--device", "cuda", "--nnodes", "2", "--nproc", "8",
                                         "--global-batch-size", "16", "--checkpoint-dir", "ck", "--steps", "100"],
                                        workdir, monkeypatch, capsys)
    assert rc == 0 and not launched, err
    for text in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@300", 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 "export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0", '--node-rank "$SLURM_NODEID"',
                 '--nnodes 2 --rdzv-endpoint "$head:$port" --resume &', 'scontrol requeue "$SLURM_JOB_ID"'):
        assert text in script, text
    path = tmp_path / "train.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0

    # Stand-ins: srun records its arguments and waits to be stopped; scontrol knows two hosts and records requeues.
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text('#!/bin/bash\nsleep 30 >/dev/null 2>&1 &\n'
                               'trap \'echo TERM >> "$LOG"; kill $!; exit 143\' TERM\n'
                               'printf "%s\\n" "$@" > "$LOG.srun"\nwait\n')
    (bin_ / "scontrol").write_text('#!/bin/bash\nif [ "$1" = show ]; then printf "nodeA\\nnodeB\\n"; else '
                                   'echo "$@" >> "$LOG"; fi\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    log = tmp_path / "log"
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", LOG=str(log), SLURM_JOB_NODELIST="node[A-B]",
               SLURM_JOB_ID="42")
    job = subprocess.Popen(["bash", str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(200):  # until srun started (at most 20 s)
        if Path(f"{log}.srun").exists():
            break
        time.sleep(0.1)
    job.send_signal(signal.SIGUSR1)
    out, _ = job.communicate(timeout=30)
    assert job.returncode == 143, out  # the step's own code: it stopped on SIGTERM
    assert log.read_text().split("\n")[:2] == ["TERM", "requeue 42"], out
    srun = Path(f"{log}.srun").read_text().splitlines()
    assert srun[:4] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c"]
    train = srun[srun.index("paraseek") + 1:]
    assert train[1:4] == ["-m", "paraseek", "train"] and "--slurm" not in train
    assert train[-5:] == ["--nnodes", "2", "--rdzv-endpoint", "nodeA:29500", "--resume"]


def test_an_output_path_is_tried_with_a_probe_file_that_is_removed(tmp_path):
    from paraseek.errors import UserError, check_writable

    # /proc takes no new file whoever asks, though os.access says yes to root
    with pytest.raises(UserError, match=r"^--run-dir /proc/x/y: /proc cannot be written \(a virtual file system"):
        check_writable("--run-dir", "/proc/x/y", folder=True)
    (tmp_path / "m.jsonl").write_text('{"step": 1}\n')
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    check_writable("--checkpoint-dir", str(tmp_path / "new" / "ck"), folder=True)  # its nearest existing parent
    check_writable("--metrics-jsonl", str(tmp_path / "m.jsonl"), folder=False)  # an existing file: appended to
    after = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    assert after == before  # no probe, no folder left behind, the file unchanged
    if os.geteuid() != 0:
        os.chmod(tmp_path / "m.jsonl", 0o444)
        with pytest.raises(UserError, match=r"m.jsonl cannot be written \(permission denied\)"):
            check_writable("--metrics-jsonl", str(tmp_path / "m.jsonl"), folder=False)
