"""Reading a paraseek training checkpoint, the one reader `paraseek train --resume`, `export`, `generate` and
`serve` share: which step folder is the newest complete one (`latest_checkpoint`: trainer state, DCP metadata and
every shard file the metadata names whole), the model the run trained and the tokenizer it trained with
(`checkpoint_source`), and its weights (`load_checkpoint_model`, `read_adapters`). train/checkpoint.py writes them.
Pure Python to import: torch loads when a checkpoint is read."""

from __future__ import annotations

import json
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from paraseek.errors import UserError
from paraseek.models.args import ModelArgs, resolve_model
from paraseek.models.lora_spec import LoRASpec, lora_spec
from paraseek.models.tokenizer import BUNDLED_TOKENIZER

_STEP = re.compile(r"step-(\d+)")


def step_of(path: Path) -> int:
    return int(_STEP.fullmatch(path.name).group(1))


def step_folders(root: str | Path) -> list[Path]:
    """The step-N folders of a checkpoint folder, oldest first (not the .tmp ones of saves that did not finish)."""
    root = Path(root)
    return sorted((p for p in root.glob("step-*") if _STEP.fullmatch(p.name) and p.is_dir()), key=step_of)


def has_checkpoints(root: str | Path) -> bool:
    return (Path(root) / "latest").exists() or bool(step_folders(root))


def checkpoint_problem(path: Path) -> str | None:
    """Why the step folder `path` is not a complete checkpoint, or None when it is: trainer_state.json readable and
    naming this step, DCP's .metadata readable, and every shard file it names present and as long as it says."""
    try:
        step = json.loads((path / "trainer_state.json").read_text())["step"]
    except FileNotFoundError:
        return "no trainer_state.json"
    except (OSError, ValueError, KeyError, TypeError):
        return "trainer_state.json is not readable"
    if step != step_of(path):
        return f"trainer_state.json says step {step}"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        return "no .metadata (DCP's index of the shards)"
    except Exception as e:  # a torn or foreign pickle: anything may come out of it
        return f".metadata is not readable ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"shard {name} is missing"
        if shard.stat().st_size < size:
            return f"shard {name} is truncated ({shard.stat().st_size:,} of {size:,} bytes)"
    return None


def latest_checkpoint(root: str | Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete step folder under `root`, or None. Newer folders that are not complete are skipped, and
    so is a `latest` that holds junk or names a folder that is gone: `warn` gets one line for each."""
    root = Path(root)
    warn = warn or (lambda message: None)
    found = None
    for path in reversed(step_folders(root)):
        problem = checkpoint_problem(path)
        if problem is None:
            found = path
            break
        warn(f"{path}: {problem}; skipped")
    try:
        named = (root / "latest").read_text(errors="replace").strip()
    except OSError:
        named = None
    if named is not None and not _STEP.fullmatch(named):
        warn(f"{root / 'latest'} holds {named[:40]!r}, not a step folder's name; ignored")
    elif named is not None and not (root / named).is_dir():
        warn(f"{root / 'latest'} names {named}, which is gone; ignored")
    return found


def needed_checkpoint(root: str | Path, advice: str, warn: Callable[[str], None] | None = None,
                      prefix: str = "") -> Path | None:
    """latest_checkpoint for a command that needs a checkpoint of `root`: None when it holds none at all; when it
    holds only damaged ones, one UserError that says why each was skipped, then `advice`. Newer damaged ones
    skipped on the way to a complete one go to `warn`."""
    skipped: list[str] = []
    found = latest_checkpoint(root, skipped.append)
    if found is None and has_checkpoints(root):
        reasons = [s.removesuffix("; skipped").removesuffix("; ignored") for s in skipped]
        more = f"; and {len(reasons) - 3} more" if len(reasons) > 3 else ""
        raise UserError(f"{prefix}{root} holds no complete checkpoint ({'; '.join(reasons[:3])}{more}); {advice}")
    for line in skipped:
        if warn:
            warn(line)
    return found


@dataclass
class ModelSource:
    """The model a MODEL argument names (infer/load.py: resolve_source) or a training checkpoint holds
    (checkpoint_source), resolved without loading a weight."""

    kind: str  # "hf" | "checkpoint" | "random"
    spec: str
    args: ModelArgs
    path: Path | None  # the HF folder, or the checkpoint's step folder
    tokenizer: Path | None  # a folder or tokenizer.json; None: token-id prompts only
    tokenizer_why: str  # where the tokenizer came from, for the first log line
    # A checkpoint of a LoRA run: its adapters, trained on the frozen base `base` (the run's --init-from folder).
    lora: LoRASpec | None = None
    base: Path | None = None
    # A checkpoint's run trained with this --chat-template file (None: the tokenizer folder's template).
    chat_template: Path | None = None


def checkpoint_step(folder: Path) -> Path | None:
    """The newest complete step folder of a training checkpoint folder (or the folder itself if it is one)."""
    if (folder / "trainer_state.json").is_file() and (folder / ".metadata").is_file():
        return folder
    return needed_checkpoint(folder, "the run was stopped before its first save completed, or the folder was "
                             "damaged since", warn=lambda line: print(f"paraseek: warning: {line}", file=sys.stderr))


def checkpoint_source(spec: str, step: Path, tok: Path | None) -> ModelSource:
    try:
        state = json.loads((step / "trainer_state.json").read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{step / 'trainer_state.json'}: not valid JSON ({e.msg}); the checkpoint is damaged") from None
    cfg = state.get("config") or {}
    model_spec = cfg.get("init_from") or cfg.get("model")
    if not model_spec:
        raise UserError(f"{step / 'trainer_state.json'}: names no model; the checkpoint was not written by paraseek train")
    args, _, folder = resolve_model(model_spec)
    why = f"--tokenizer {tok}" if tok else ""
    if tok is None:
        if cfg.get("tokenizer"):
            tok, why = Path(cfg["tokenizer"]), f"the one it was trained with ({cfg['tokenizer']})"
        elif folder is not None and (folder / "tokenizer.json").is_file():
            tok, why = folder, f"its --init-from folder's ({folder})"
        elif cfg.get("data") and cfg.get("data") != "synthetic":
            tok, why = BUNDLED_TOKENIZER, f"the one it was trained with (the bundled {BUNDLED_TOKENIZER.name})"
        else:
            why = "none (trained on synthetic tokens): token-id prompts only"
    lora = lora_spec(cfg.get("lora_rank", 0), cfg.get("lora_alpha", 0.0), cfg.get("lora_targets", ""), args, model_spec)
    template = Path(cfg["chat_template"]) if cfg.get("chat_template") and tok is not None else None
    if template is not None and not template.is_file():
        raise UserError(f"{step}: its run's --chat-template {template} is gone; the checkpoint's chat format needs it")
    return ModelSource("checkpoint", spec, args, step, tok, why, lora, folder, template)


def with_run_mtp_modules(src, step_dir: Path):
    """The checkpoint's model with the MTP modules its run held (train/mtp.py: --mtp-layers may have created some
    beside, or without, those of the model it names), which its trainer state records."""
    import dataclasses

    n = json.loads((step_dir / "trainer_state.json").read_text()).get("mtp_modules")
    if n is None or n == src.args.n_mtp_layers:
        return src
    return dataclasses.replace(src, args=src.args.replace(n_mtp_layers=n))


def load_checkpoint_model(src: ModelSource, dtype, device, merge_lora: bool = True):
    """The checkpoint's model. A LoRA run's checkpoint holds the adapters only: they are put on its base folder's
    weights, merged into them (the plain model generate, serve and export run) or, with merge_lora=False, as LoRA
    modules (models/lora.py), in fp32."""
    import torch

    from paraseek.models.deepseek import Transformer, _keep_fp32_buffers

    if src.lora is not None:
        from paraseek.models.hf import load_pretrained
        from paraseek.models.lora import apply_lora, merge_state

        model = load_pretrained(src.base, dtype=torch.float32, device=device)
        adapters = read_adapters(src, device)
        if merge_lora:
            model.load_state_dict(merge_state({**model.state_dict(), **adapters}, src.lora))
        else:
            apply_lora(model, src.lora)
            model.load_state_dict({**model.state_dict(), **adapters})
    else:
        with torch.device("meta"):
            model = Transformer(src.args)
        model.to_empty(device=device)
        state = {"model": model.state_dict()}
        _dcp_load(src, state)
        model.load_state_dict(state["model"])
    model.init_buffers(torch.device(device))
    model.to(dtype)
    _keep_fp32_buffers(model)
    return model.eval()


def _dcp_load(src: ModelSource, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(src.path))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UserError(f"{src.path}: cannot load the model from this checkpoint ({first[:200]})") from None


def read_adapters(src: ModelSource, device="cpu") -> dict:
    """A LoRA checkpoint's adapters as whole fp32 tensors by our names (without the base, which is never read)."""
    import torch

    from paraseek.models.deepseek import Transformer
    from paraseek.models.lora import apply_lora, is_adapter

    with torch.device("meta"):  # the adapters' names and shapes, from the run's spec
        model = Transformer(src.args)
    apply_lora(model, src.lora)
    adapters = {n: torch.empty(t.shape, dtype=torch.float32, device=device)
                for n, t in model.state_dict().items() if is_adapter(n)}
    _dcp_load(src, {"model": adapters})
    return adapters
