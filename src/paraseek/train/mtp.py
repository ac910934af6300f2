"""Multi-token prediction in training (DeepSeek-V3 report, sec. 2.2): how many MTP modules a run trains
(--mtp-layers D), the weight of their loss at each step (--mtp-loss-weight, with V3's switch from 0.3 to 0.1), and
the checks of these flags. The modules themselves are models/deepseek.py's MTPModule; the loss is

    L = L_main + (lambda / D) * sum_k L_MTP^k,    L_MTP^k = -(1/T) sum_i log P^k_i[t_{i+k+1}]    (V3 eqs. 24-25)

with T the main loss's trained tokens (the same normalizer for every term, so every layout computes the same loss)
and the sum over the positions that have a target (models/loss.py: mtp_labels). Each depth runs over whole rows, so
that every tensor stays [B, T, D] for sequence parallelism and the pipeline's fixed shapes: its last k positions,
which have no target, pass through the module with zero embeddings (and count in its MoE's expert loads); causal
attention keeps them out of every other position.

Defaults: D = the MTP modules the model holds (V3's num_nextn_predict_layers, when its folder has their weights;
0 for the other families, whose modules --mtp-layers creates fresh), lambda = 0.1: the weight V3 trained its last
4.8T tokens with, and so the one its released checkpoints finished with; V3's pre-training recipe (0.3 for the first
10T tokens, then 0.1) is --mtp-loss-weight 0.3 --mtp-loss-weight-final 0.1 --mtp-loss-weight-switch-step N.
"""

from __future__ import annotations

from paraseek.errors import UserError
from paraseek.models.weights import held_mtp_modules

DEFAULT_WEIGHT = 0.1


def depth_of(mtp_layers: int, held: int) -> int:
    """The depths a run trains: --mtp-layers, or (-1) as many as the model holds."""
    return held if mtp_layers < 0 else mtp_layers


def run_depth(cfg, args) -> int:
    return depth_of(cfg.mtp_layers, held_mtp_modules(args, cfg.init_from or None))


def run_args(args, held: int, depth: int):
    """The architecture a run builds: the model's, holding its own MTP modules or as many as it trains, whichever is
    more (the ones beyond its own created fresh)."""
    return args.replace(n_mtp_layers=max(held, depth))


def loss_weight(cfg, step: int) -> float:
    """lambda at optimizer step `step` (1-based): --mtp-loss-weight, then --mtp-loss-weight-final after step
    --mtp-loss-weight-switch-step."""
    if cfg.mtp_loss_weight_final >= 0 and step > cfg.mtp_loss_weight_switch_step:
        return cfg.mtp_loss_weight_final
    return DEFAULT_WEIGHT if cfg.mtp_loss_weight < 0 else cfg.mtp_loss_weight


def describe(cfg, depth: int, held: int) -> str:
    """The header's MTP line."""
    fresh = depth - held
    origin = "the model's own" if fresh <= 0 else "created fresh" if not held else \
        f"{held} the model's own, {fresh} created fresh"
    if cfg.lora_rank:
        origin += "; frozen under LoRA: their loss trains the main layers' adapters"
    weight = f"loss weight {loss_weight(cfg, 1):g}"
    if cfg.mtp_loss_weight_final >= 0:
        weight += f", {cfg.mtp_loss_weight_final:g} after step {cfg.mtp_loss_weight_switch_step}"
    return (f"MTP: {depth} depth{'s' if depth > 1 else ''} ({origin}), {weight} / {depth} per depth; logged as "
            + ", ".join(f"mtp_loss_{k}" for k in range(1, depth + 1)))


def check_mtp(cfg, args, model: str) -> None:
    """The MTP flags against the model and the rest of the run (one line each)."""
    held = held_mtp_modules(args, cfg.init_from or None)
    depth = depth_of(cfg.mtp_layers, held)
    weights = [f for f, v in (("--mtp-loss-weight", cfg.mtp_loss_weight >= 0),
                              ("--mtp-loss-weight-final", cfg.mtp_loss_weight_final >= 0),
                              ("--mtp-loss-weight-switch-step", cfg.mtp_loss_weight_switch_step > 0)) if v]
    if depth == 0 and weights:
        why = "--mtp-layers 0 trains none" if cfg.mtp_layers == 0 else f"{model} holds no MTP modules"
        raise UserError(f"{weights[0]} weighs the multi-token-prediction loss, and this run has none ({why}); add "
                        "--mtp-layers D to train D of them, or leave it out")
    if (cfg.mtp_loss_weight_final >= 0) != (cfg.mtp_loss_weight_switch_step > 0):
        raise UserError("--mtp-loss-weight-final W and --mtp-loss-weight-switch-step N go together (the weight "
                        "becomes W after step N): give both, or neither")
    if depth >= cfg.seq_len:
        raise UserError(f"--mtp-layers {depth}: depth k predicts the token k + 1 ahead, and a --seq-len {cfg.seq_len} "
                        f"window has no target that far; use --mtp-layers {cfg.seq_len - 1} or fewer")
    if cfg.lora_rank and depth > held:
        raise UserError(f"--mtp-layers {depth} with --lora-rank: {model} holds {held} MTP module(s), and LoRA trains "
                        "adapters on the main layers only, so a module created fresh would stay at its random start; "
                        f"use --mtp-layers {held} or fewer")


def check_resume(saved_depth: int, depth: int, path) -> None:
    """A checkpoint resumes under the MTP depth it was written with: the optimizer holds state for exactly the
    modules that trained."""
    if saved_depth != depth:
        raise UserError(f"{path} was written by a run that trained {saved_depth} MTP depth(s), and this one trains "
                        f"{depth}: resume with --mtp-layers {saved_depth} (the optimizer state is that of the modules "
                        "that trained)")
