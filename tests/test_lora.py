"""LoRA (`lit_lm.lora`): the adapters start as the identity change, only they train, the factors initialise from their
names (meta builds), the tp engine cuts them with their base linear, and every layout equals one process with the
base bit for bit untouched and optimizer state for the adapters only."""

from __future__ import annotations

import json
from functools import partial

import lightning as L
import pytest
import torch

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.config_keys import unknown_keys
from lit_lm.lora import LoRA, LoRAExperts, LoRALinear, lora_factor, merge_adapters
from lit_lm.module import LanguageModel
from lit_lm.param_groups import param_groups
from lit_lm.parity import MOE, TINY, Case, assert_parity, run_parity
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.ddp import DataParallelStrategy
from lit_lm.strategies.ep import ExpertParallelStrategy
from lit_lm.strategies.placement import materialize
from lit_lm.strategies.pp import PipelineStrategy
from lit_lm.strategies.tp import TensorParallelStrategy
from lit_lm.strategies.tp_layers import TPGroup, parallelize_model
from lit_lm.strategies.zero import ZeroStrategy
from lit_lm.strategies.zero_engine import model_state_bytes

LORA = LoRA(rank=4, alpha=8.0)  # every target


def adapted(cfg: dict = TINY, lora: LoRA = LORA, seed: int = 0) -> LanguageModel:
    L.seed_everything(seed, verbose=False)
    module = LanguageModel(ModelConfig(**cfg), lora=lora)
    module.configure_model()
    return module


def base(cfg: dict = TINY, seed: int = 0) -> LanguageModel:
    L.seed_everything(seed, verbose=False)
    module = LanguageModel(ModelConfig(**cfg))
    module.configure_model()
    return module


def test_bad_options_are_one_line_naming_the_valid_targets() -> None:
    with pytest.raises(ConfigError, match=r"^model\.init_args\.lora\.targets: unknown qq; choose from q, k, v, o, "
                                          r"gate, up, down$"):
        LoRA(targets=["q", "qq"])
    with pytest.raises(ConfigError, match="rank >= 1"):
        LoRA(rank=0)
    with pytest.raises(ConfigError, match="fp8 with model.init_args.lora"):
        LanguageModel(ModelConfig(**TINY), lora=LORA, fp8="tensorwise")
    (line,) = unknown_keys([], ["--model.init_args.lora.rankk", "3"])  # a misspelled key, before parsing
    assert "did you mean --model.init_args.lora.rank?" in line
    assert unknown_keys([], ["--model.init_args.lora.alpha", "3"]) == []


@pytest.mark.parametrize("cfg", [TINY, MOE], ids=["dense", "moe"])
def test_adapters_start_as_the_base_model_and_only_they_train(cfg: dict) -> None:
    """B = 0: the adapted model's logits are the base model's bit for bit; every parameter but the factors frozen,
    and the factors in one group without weight decay (never Muon's matrices)."""
    lora, plain = adapted(cfg), base(cfg)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(lora.model(x), plain.model(x)), "step 0: the adapted model computes another output"
    trainable = {n for n, p in lora.model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora.model.named_parameters() if lora_factor(n)}
    # two factors per adapted linear; MoE's block 1: attention, the shared expert's three, the experts' three stacks
    per_linear = 2 * 7 * cfg["n_layers"] if not cfg.get("moe_experts") else 2 * 7 + 2 * (4 + 3 + 3)
    assert len(trainable) == per_linear
    for n, p in lora.model.named_parameters():  # the base's parameters are the plain model's, by name
        if not lora_factor(n):
            assert torch.equal(p, plain.model.get_parameter(n)), n
    for split in (False, True):
        groups = param_groups(lora.model, 0.1, False, split_matrices=split)
        assert len(groups) == 1 and groups[0]["weight_decay"] == 0.0 and "matrix" not in groups[0]
        assert sum(p.numel() for p in groups[0]["params"]) == sum(p.numel() for n, p in
                                                                 lora.model.named_parameters() if lora_factor(n))
    if cfg.get("moe_experts"):  # one adapter per expert, stacked like the expert weights
        experts = lora.model.blocks["1"].mlp.experts
        assert isinstance(experts, LoRAExperts)
        assert experts.w_gate_lora_A.shape == (4, 4, 32) and experts.w_down_lora_B.shape == (4, 32, 4)
    assert isinstance(lora.model.blocks["0"].attn.wq, LoRALinear)


def test_factors_from_their_names_on_a_meta_build() -> None:
    """A from (init seed, name) whatever builds it: a meta model materialised by name equals the eager one; B zero."""
    eager = adapted().model
    with torch.device("meta"):
        meta = LanguageModel(ModelConfig(**TINY), lora=LORA)
        meta.configure_model()
    meta.model.init_seed = eager.init_seed
    materialize(meta.model, torch.device("cpu"), meta.model.init_parameter, meta.model.init_buffer)
    for n, p in eager.named_parameters():
        assert torch.equal(p, meta.model.get_parameter(n)), n
        assert p.requires_grad == meta.model.get_parameter(n).requires_grad, n
    a, b = eager.blocks["0"].attn.wq.lora_A, eager.blocks["0"].attn.wq.lora_B
    assert a.abs().max() <= 1 / 32 ** 0.5 and a.std() > 0 and not b.any()
    assert not torch.equal(a, eager.blocks["0"].attn.wk.lora_A[:, :32])  # per name


def test_tp_cuts_each_factor_with_its_base_linear() -> None:
    """Column-parallel base (q, k, v, gate, up: output rows split): B's rows split, A whole with a partial gradient;
    row-parallel base (o, down: input columns split): A's columns split, B whole with a partial gradient. Rank 1 of
    2 holds the second half; the forward is the adapter's own on the shard."""
    whole = adapted().model
    model = adapted().model
    shards = parallelize_model(model, model.tensor_parallel_plan(), TPGroup(None, 2, 1))
    for name, style in (("attn.wq", "column"), ("attn.wk", "column"), ("mlp.w_up", "column"),
                        ("attn.wo", "row"), ("mlp.w_down", "row")):
        full, part = whole.get_submodule(f"blocks.0.{name}"), model.get_submodule(f"blocks.0.{name}")
        assert isinstance(part, LoRALinear), name
        dim, split, kept = (0, "lora_B", "lora_A") if style == "column" else (1, "lora_A", "lora_B")
        half = full.weight.shape[dim] // 2  # W and the split factor: the same features
        assert torch.equal(part.weight, full.weight.narrow(dim, half, half)), name
        assert torch.equal(getattr(part, split), getattr(full, split).narrow(dim, half, half)), f"{name}.{split}"
        assert torch.equal(getattr(part, kept), getattr(full, kept)), f"{name}.{kept}"
        assert shards.sharded[f"blocks.0.{name}.{split}"] == (dim, getattr(full, split).shape)
        assert f"blocks.0.{name}.{kept}" in shards.partial and f"blocks.0.{name}.{split}" not in shards.partial
        assert getattr(part, split).requires_grad and not part.weight.requires_grad


@pytest.mark.parametrize("cfg", [TINY, MOE], ids=["dense", "moe"])
def test_merge_computes_what_the_adapted_model_does(cfg: dict) -> None:
    lora = adapted(cfg).model
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if lora_factor(n) == "B":
                p.normal_(0, 0.05)
    merged = merge_adapters(lora.state_dict(), LORA)
    assert not any(lora_factor(k) for k in merged)
    plain = base(cfg).model
    plain.load_state_dict(merged)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    moved = (lora(x) - base(cfg).model(x)).abs().max()
    assert moved > 1e-2  # the adapters change the output ...
    torch.testing.assert_close(plain(x), lora(x), rtol=1e-5, atol=1e-5)  # ... and the merged weights hold that


# -- every layout against one process ---------------------------------------------------------------------------------
class OptimizerState(L.Callback):
    """After training: the elements of optimizer state (tensors of >= 1 dim) this rank holds; at the last step the
    bytes of parameters, gradients and optimizer state it holds (`model_state_bytes`)."""

    def __init__(self) -> None:
        self.numel = 0
        self.bytes: dict[str, int] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer) -> None:
        self.bytes = model_state_bytes(module, getattr(optimizer, "optimizer", optimizer))

    def on_train_end(self, trainer: L.Trainer, *args) -> None:
        optimizer = trainer.optimizers[0]
        self.numel = sum(v.numel() for s in optimizer.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.ndim >= 1)


MODULE = ("lit_lm.module.LanguageModel", (("lora", LORA),))
LAYOUTS = {"lm_ddp": (partial(DataParallelStrategy, bucket_cap_mb=0.01), TINY),
           "zero1": (partial(ZeroStrategy, stage=1), TINY),
           "zero3": (partial(ZeroStrategy, stage=3), TINY),
           "tp2": (partial(TensorParallelStrategy, 2, sequence_parallel=True, bucket_cap_mb=0.01), TINY),
           "ep2": (partial(ExpertParallelStrategy, expert_parallel_size=2, bucket_cap_mb=0.01), MOE),
           "pp2": (partial(PipelineStrategy, pipeline_parallel_size=2, microbatches=2, schedule="1f1b"), TINY),
           "cp2": (partial(ComposedStrategy, context_parallel_size=2), TINY)}
CASES = [Case(strategy, model=dict(cfg), optimizer=opt, module=MODULE, callbacks=(OptimizerState(),),
              label=f"lora {name} {opt}")
         for name, (strategy, cfg) in LAYOUTS.items() for opt in ("sgd", "adamw")]
FULL_ZERO3 = Case(LAYOUTS["zero3"][0], optimizer="adamw", callbacks=(OptimizerState(),), label="full zero3 adamw")


def test_lora_matches_one_process_under_every_layout() -> None:
    """lm_ddp, zero1, zero3, tp2 (sequence parallel), ep2 (MoE), pp2 (1F1B), cp2: losses, every gradient part, final
    parameters as one process, 3 steps of SGD and of AdamW; the base weights bit for bit their initial values on
    every rank and in the reference; AdamW's state only the adapters' (m and v: 2 elements per factor element),
    each held once over the ZeRO ranks. Under zero3 a rank holds the frozen base's rows (1/2) as full fine-tuning
    does, and gradients and optimizer state for the adapters' rows only."""
    *runs, full = run_parity([*CASES, FULL_ZERO3], 2)
    for run in runs:
        assert_parity(run)
    for cfg in (TINY, MOE):
        start = {f"model.{n}": p.detach() for n, p in adapted(cfg).model.named_parameters()}
        factors = sum(p.numel() for n, p in start.items() if lora_factor(n))
        for run in (r for r in runs if r["case"].model == cfg):
            tag = run["case"].label
            moved = [n for n in start if lora_factor(n) and not torch.equal(run["single"]["params"][n], start[n])]
            assert moved, f"{tag}: the adapters did not train"
            for got in [run["single"], *run["ranks"]]:
                for n, value in got["params"].items():
                    if n in start and not lora_factor(n):
                        assert torch.equal(value, start[n]), f"{tag}: the frozen {n} changed"
            if run["case"].optimizer != "adamw":
                continue
            held = [got["callbacks"][0].numel for got in run["ranks"]]
            name = tag.split()[1]
            if name.startswith("zero"):  # sharded over the 2 ranks: each element once
                assert sum(held) == 2 * factors, f"{tag}: optimizer state {held}, adapters {factors}"
            elif name == "pp2":  # each stage its layers' adapters
                assert sum(held) == 2 * factors and 0 < min(held), f"{tag}: optimizer state {held}, adapters {factors}"
            elif name in ("lm_ddp", "cp2"):  # replicated
                assert held == [2 * factors] * 2, f"{tag}: optimizer state {held}, adapters {factors}"
            else:  # tp / ep: a rank holds its shard of the split factors, the whole of the others
                assert factors < sum(held) < 4 * factors and max(held) < 2 * factors, f"{tag}: {held}, {factors}"
            if name == "zero3":  # bytes per rank at the step, against full fine-tuning under zero3
                for got, ref in zip(run["ranks"], full["ranks"]):
                    lora_bytes, full_bytes = got["callbacks"][0].bytes, ref["callbacks"][0].bytes
                    assert lora_bytes["grads"] == 4 * factors // 2  # the adapters' rows: none for the frozen base
                    assert lora_bytes["params"] == full_bytes["params"] + 4 * factors // 2  # the base sharded as ever
                    assert 0 <= lora_bytes["optimizer"] - 8 * factors // 2 < 1024  # m, v (+ step counters)
                    assert full_bytes["grads"] == full_bytes["params"]  # full: every parameter's gradient rows


# -- export: merged into the base weights, or the adapter alone in PEFT's format ---------------------------------------
def test_export_merged_and_peft_adapter_compute_the_adapted_model(tmp_path) -> None:
    """A LoRA run through the CLI, exported twice by scripts/ckpt.py: `--merge-lora` loads in transformers with the
    adapted model's logits (not the base's), as `lit-lm generate` loads the checkpoint; without it, PEFT's adapter
    folder: its keys name the base export's modules with PEFT's prefix and factor shapes, its config r / lora_alpha /
    target_modules, and W + (lora_alpha / r) B A on those modules of the base export (what PEFT computes) gives the
    adapted logits; with peft installed,
    `PeftModel.from_pretrained` itself (it is not in lit-lm's lock: then the format is checked as above only)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from test_cli import run_cli, run_script, tiny_args

    from lit_lm.checkpoints import model_state_dict, read_checkpoint
    from lit_lm.generate import load
    from lit_lm.hf.exporter import write_hf
    from lit_lm.lora import add_adapters, lora_from
    from lit_lm.model import Transformer

    fit = run_cli("fit", *tiny_args(tmp_path), "--trainer.max_steps", "4", "--model.init_args.lr", "0.05",
                  "--model.init_args.lora", "{rank: 4, alpha: 8, targets: [q, v, o, up, down]}", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    last, merged_dir, adapter_dir = tmp_path / "run/checkpoints/last.ckpt", tmp_path / "merged", tmp_path / "adapter"
    for args in (("--merge-lora", last, merged_dir), (last, adapter_dir)):
        export = run_script("scripts/ckpt.py", "export-hf", *args, cwd=tmp_path)
        assert export.returncode == 0, export.stderr[-3000:]

    checkpoint = read_checkpoint(last)
    hparams = checkpoint["hyper_parameters"]
    cfg, lora = ModelConfig(**hparams["config"]), lora_from(hparams["lora"])
    adapted_model = Transformer(cfg).eval()
    add_adapters(adapted_model, lora)
    state = model_state_dict(checkpoint)
    adapted_model.load_state_dict(state)
    base_state = {k: v for k, v in state.items() if not lora_factor(k)}
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted_model(ids)
        base_model = Transformer(cfg).eval()
        base_model.load_state_dict(base_state)
        assert (expected - base_model(ids)).abs().max() > 1e-3  # the adapters trained away from zero

        merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-4)
        generating, _ = load(str(last))  # `lit-lm generate` on the LoRA checkpoint: the adapters folded in
        torch.testing.assert_close(generating(ids), expected, rtol=0, atol=1e-4)

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == ["down_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    assert len(tensors) == 2 * 5 * cfg.n_layers
    write_hf(base_state, cfg, None, tmp_path / "base")
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    modules = dict(base_hf.named_modules())
    for key, value in tensors.items():
        assert key.startswith("base_model.model.model.layers.") and key.endswith((".lora_A.weight", ".lora_B.weight"))
        module = modules[key.removeprefix("base_model.model.").rsplit(".", 2)[0]]
        rank_dim = 0 if ".lora_A." in key else 1
        assert value.shape[rank_dim] == 4
        assert value.shape[1 - rank_dim] == (module.in_features if rank_dim == 0 else module.out_features), key
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    try:
        import peft
    except ImportError:
        peft = None
    if peft is not None:  # on its own load: PeftModel wraps the modules of the model it is given in place
        fresh = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        with torch.no_grad():
            got = peft.PeftModel.from_pretrained(fresh, adapter_dir).eval()(ids).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    with torch.no_grad():  # PEFT's update, W + (lora_alpha / r) B A, on the named modules of the base export
        for key, a in tensors.items():
            if ".lora_A." in key:
                module = modules[key.removeprefix("base_model.model.").rsplit(".", 2)[0]]
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                module.weight += config["lora_alpha"] / config["r"] * b @ a
        torch.testing.assert_close(base_hf(ids).logits, expected, rtol=0, atol=1e-4)


def test_lora_on_an_imported_model_under_zero3_and_tp(tmp_path) -> None:
    """From a Hugging Face folder (`init_from`: the base read by slice, the factors drawn from their names):
    zero3 x 2 and tp2 as one process, and the base after training is the file's, bit for bit."""
    transformers = pytest.importorskip("transformers")
    from test_hf_import import SHAPE, save_hf

    save_hf(tmp_path, transformers.LlamaConfig(**SHAPE))
    module = ("lit_lm.module.LanguageModel", (("init_from", str(tmp_path)), ("lora", LORA)))
    cases = [Case(LAYOUTS[name][0], model=dict(TINY), steps=2, optimizer="adamw", module=module, label=f"hf {name}")
             for name in ("zero3", "tp2")]
    runs = run_parity(cases, 2)
    for run in runs:
        assert_parity(run)
    imported = LanguageModel(ModelConfig(**TINY), init_from=str(tmp_path))
    imported.configure_model()
    for name, p in imported.named_parameters():
        for got in [runs[0]["single"], *(r for run in runs for r in run["ranks"])]:
            assert torch.equal(got["params"][name], p.detach()), name
    trained_b = [v for n, v in runs[0]["single"]["params"].items() if lora_factor(n) == "B"]
    assert len(trained_b) == 14 and all(v.any() for v in trained_b)  # every B moved off zero: the adapters trained


def test_qk_clip_refuses_frozen_projections() -> None:
    """QK-clip scales wq and wk in place: with LoRA they are the frozen base, so it is refused in one line."""
    from lit_lm.callbacks.qk_clip import QKClip

    module = adapted()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[QKClip()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = torch.randint(0, 64, (4, 17))
    with pytest.raises(ConfigError, match=r"QKClip cannot clip .*frozen \(LoRA"):
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))


def test_lora_resumes_a_one_process_checkpoint_under_zero3_and_tp() -> None:
    """A one-process LoRA run's checkpoint (the frozen base, the adapters, AdamW's state for the adapters only)
    resumed under zero3 x 2 and tp2: the state each rank starts from, then 2 more steps, as one process."""
    first = Case(model=dict(TINY), optimizer="adamw", module=MODULE, steps=2)
    cases = [Case(LAYOUTS[name][0], model=dict(TINY), optimizer="adamw", module=MODULE, steps=2, resume=first,
                  label=f"resumed {name}") for name in ("zero3", "tp2")]
    for run in run_parity(cases, 2):
        assert run["single"]["start"] is not None
        assert_parity(run)
