"""Lean activations (`rl_lightning.models.lean`): the SwiGLU MLP and RMSNorm with fewer saved tensors give the stock
modules' outputs and gradients bit for bit (fp32, bf16 autocast, bf16 weights; single modules, the tiny Qwen2 and
SmolLM2-135M whole), save h + 2 i instead of h + 4 i MLP values and h + 1 instead of 2 h + 1 per norm per token,
patch only Llama-style modules, and come off exactly. LoRA, checkpointing, FSDP2 and TP: test_lean_parallel.py."""

import importlib.util
from collections import defaultdict

import pytest
import torch
from conftest import TINY_MODEL
from torch import nn

from rl_lightning.assets import real
from rl_lightning.data.steps import pack
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.models import lean
from rl_lightning.models.lean import LeanModule, apply_lean_activations, remove_lean_activations, rms_norm, swiglu_down
from rl_lightning.models.loading import load_causal_lm

H, I = 64, 160  # noqa: E741 (the hidden and intermediate sizes of the single-module tests)
# fp32 parameters under bf16 autocast, bf16 parameters, plain fp32: (parameter dtype, autocast)
PRECISIONS = {"fp32": (torch.float32, False), "bf16-autocast": (torch.float32, True), "bf16": (torch.bfloat16, False)}


@pytest.fixture(scope="session")
def smollm2():
    if importlib.util.find_spec("gguf") is None and not real.is_built(real.model_dir()):
        pytest.skip("SmolLM2-135M-Instruct is not built and the [real] extra is missing")
    return str(real.build_real())


def micro_batch(lengths=(37, 20, 51), vocab=300, seed=0):
    """A packed (1, N) row of random token ids."""
    gen = torch.Generator().manual_seed(seed)
    return pack([TokenizedExample(torch.randint(0, vocab, (n,), generator=gen).tolist(), [1] * n) for n in lengths],
                pad_token_id=0)


def model_step(model, batch):
    """Logits and every parameter gradient of a packed forward and a random-weighted sum of the logits' backward."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_bitwise(stock, patched):
    assert torch.equal(stock[0], patched[0]), (stock[0] - patched[0]).abs().max()
    assert stock[1].keys() == patched[1].keys() and len(stock[1]) > 0
    for name, grad in stock[1].items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(grad, patched[1][name]), (name, (grad - patched[1][name]).abs().max())


def _llama_modules(bias=False, dtype=torch.float32):
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP, LlamaRMSNorm

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I, hidden_act="silu", mlp_bias=bias))
    norm = LlamaRMSNorm(H, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()  # away from ones, so the weight's gradient matters
    return mlp.to(dtype), norm.to(dtype)


def module_step(module, x, autocast):
    """Output, input gradient and parameter gradients of `module` on a copy of x (under CPU bf16 autocast or not)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = module(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype))
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


# ------------------------------------------------------------------------------------------------ (a) single modules


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("precision", PRECISIONS.values(), ids=PRECISIONS.keys())
def test_single_modules_equal_stock_bitwise(precision, bias):
    """Tolerance 0 in every precision: the same aten ops in the same order (autocast casting as in the stock forward)."""
    dtype, autocast = precision
    for module in _llama_modules(bias, dtype):
        x = torch.randn(2, 37, H, generator=torch.Generator().manual_seed(2)).to(dtype)
        stock = module_step(module, x, autocast)
        assert apply_lean_activations(module) == 1
        patched = module_step(module, x, autocast)
        assert remove_lean_activations(module) == 1
        assert patched[0].dtype == stock[0].dtype == (torch.bfloat16 if autocast and module.__class__.__name__ ==
                                                      "LlamaMLP" else dtype)
        assert torch.equal(patched[0], stock[0]) and torch.equal(patched[1], stock[1])
        assert patched[2].keys() == stock[2].keys()
        for name, grad in stock[2].items():
            assert grad.abs().sum() > 0 and torch.equal(patched[2][name], grad), name


def test_rms_norm_of_a_bf16_input_with_fp32_weight_and_2d_rows():
    """Mixed dtypes (fp32 weight times the bf16 normalised input) and (N, h) rows: still the stock bits."""
    _, norm = _llama_modules()
    x = torch.randn(29, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    stock = module_step(norm, x, autocast=False)
    apply_lean_activations(norm)
    patched = module_step(norm, x, autocast=False)
    assert stock[0].dtype == torch.float32 and stock[1].dtype == torch.bfloat16
    assert torch.equal(patched[0], stock[0]) and torch.equal(patched[1], stock[1])
    assert torch.equal(patched[2]["weight"], stock[2]["weight"])


def test_functions_save_only_their_inputs_and_the_rstd():
    """swiglu_down keeps (gate, up, weight), rms_norm (x, weight, rstd (..., 1)); the outputs are the formulas'."""
    gen = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(3, 5, I, generator=gen, requires_grad=True) for _ in range(2))
    weight, x = torch.randn(H, I, generator=gen, requires_grad=True), torch.randn(3, 5, H, generator=gen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = swiglu_down(gate, up, weight)
    assert torch.equal(out, nn.functional.linear(nn.functional.silu(gate) * up, weight))
    assert [t.data_ptr() for t in saved] == [gate.data_ptr(), up.data_ptr(), weight.data_ptr()]
    saved.clear()
    x.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        normed = rms_norm(x, weight[:, 0], 1e-6)
    expected = weight[:, 0] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(normed, expected)
    assert [t.shape for t in saved] == [x.shape, (H,), (3, 5, 1)] and saved[0].data_ptr() == x.data_ptr()


# ------------------------------------------------------------------------------------------------ (b) whole models


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_tiny_model_equals_stock_bitwise(autocast):
    """Logits and every parameter gradient, tolerance 0 (the norms hand autograd the input's two gradient terms
    separately, so the residual stream adds its three terms in the stock order)."""
    model = load_causal_lm(str(TINY_MODEL), lean_activations=False)
    batch = micro_batch()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        stock = model_step(model, batch)
        assert apply_lean_activations(model) == 2 * 3 + 1  # per layer an MLP and two norms; the final norm
        patched = model_step(model, batch)
    assert stock[0].dtype == (torch.bfloat16 if autocast else torch.float32)
    assert_bitwise(stock, patched)


def test_smollm2_equals_stock_bitwise(smollm2):
    model = load_causal_lm(smollm2, lean_activations=False)
    batch = micro_batch((61, 24, 43), vocab=49152)
    stock = model_step(model, batch)
    assert apply_lean_activations(model) == 30 * 3 + 1
    assert_bitwise(stock, model_step(model, batch))


# ------------------------------------------------------------------------------------------------ (c) saved bytes


def saved_values_per_token(model, batch):
    """Saved-activation fp32 values per token per decoder layer of a training forward: the MLP's, the two norms',
    the whole layer's. Storages are counted once (gate_proj and up_proj save the same x) and parameters never."""
    layers = model.model.layers
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, inside, totals = set(), [], defaultdict(int)

    def pack_hook(tensor):
        storage = tensor.untyped_storage()
        if inside and storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            for part in set(inside):
                totals[part] += storage.nbytes()
        return tensor

    handles = []
    for layer in layers:
        for part, module in (("layer", layer), ("mlp", layer.mlp), ("norms", layer.input_layernorm),
                             ("norms", layer.post_attention_layernorm)):
            handles.append(module.register_forward_pre_hook(lambda m, a, part=part: inside.append(part) and None))
            handles.append(module.register_forward_hook(lambda m, a, o: inside.pop() and None))
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    for handle in handles:
        handle.remove()
    scale = batch["input_ids"].numel() * len(layers) * 4  # tokens x layers x fp32 bytes
    return {part: total / scale for part, total in totals.items()}


@pytest.mark.parametrize("model_name", ["tiny", "smollm2"])
def test_saved_activations_drop_to_the_closed_form(model_name, request):
    name = str(TINY_MODEL) if model_name == "tiny" else request.getfixturevalue("smollm2")
    model = load_causal_lm(name, lean_activations=False)
    h, i = model.config.hidden_size, model.config.intermediate_size  # tiny: 128, 256; SmolLM2: 576, 1536
    batch = micro_batch((61, 24, 43))
    stock = saved_values_per_token(model, batch)
    apply_lean_activations(model)
    patched = saved_values_per_token(model, batch)
    assert stock["mlp"] == h + 4 * i and patched["mlp"] == h + 2 * i  # SmolLM2: 6720 -> 3648
    assert stock["norms"] == 2 * (2 * h + 1) and patched["norms"] == 2 * (h + 1)  # SmolLM2: 2306 -> 1154
    assert stock["layer"] - patched["layer"] == 2 * i + 2 * h  # attention unchanged; SmolLM2: 11727.3 -> 7503.3


# ------------------------------------------------------------------------------------------------ matching, removal


def test_only_llama_style_modules_are_patched():
    """Gemma's (1 + weight) and OLMo-2's norms, a GELU MLP and an in-place SiLU are not Llama's maths: left alone."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    mlp, _ = _llama_modules()
    gelu = _llama_modules()[0]
    gelu.act_fn = nn.GELU()
    inplace = _llama_modules()[0]
    inplace.act_fn = nn.SiLU(inplace=True)
    torch_silu = _llama_modules()[0]
    torch_silu.act_fn = nn.SiLU()
    patched = nn.ModuleList([mlp, torch_silu, MistralRMSNorm(H), Qwen3RMSNorm(H)])
    skipped = nn.ModuleList([gelu, inplace, GemmaRMSNorm(H), Olmo2RMSNorm(H), nn.RMSNorm(H), nn.Linear(H, H)])
    assert apply_lean_activations(patched) == 4 and apply_lean_activations(skipped) == 0
    assert all(isinstance(m, LeanModule) and type(m).__name__ == type(m).base.__name__ for m in patched)
    assert not any(isinstance(m, LeanModule) or "forward" in vars(m) for m in skipped.modules())
    assert apply_lean_activations(patched) == 0  # already patched


def test_remove_restores_the_original_classes_exactly():
    model = load_causal_lm(str(TINY_MODEL), lean_activations=False)
    own = model.model.norm.forward  # a forward replaced on the instance: that module is left as it is
    model.model.norm.forward = own
    batch = micro_batch()
    stock = model_step(model, batch)
    before = {name: (type(m), dict(vars(m))) for name, m in model.named_modules()}
    assert apply_lean_activations(model) == 6 and type(model.model.norm) is before["model.norm"][0]
    assert remove_lean_activations(model) == 6 and remove_lean_activations(model) == 0
    for name, module in model.named_modules():
        assert (type(module), vars(module)) == before[name], name
    assert_bitwise(stock, model_step(model, batch))


def test_compiled_blocks_compile_once_for_every_layer():
    """torch.compile of each decoder block (strategy.compile) traces one graph for all blocks, as without the patch:
    one forward object per instance made dynamo guard on its id and recompile per layer (eager after 8: H200 run,
    2026-11-28), and the norm's autograd Function broke the graph. Compiled, the stock forwards run."""
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP, LlamaRMSNorm

    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.norm, self.mlp = LlamaRMSNorm(config.hidden_size, eps=1e-6), LlamaMLP(config)

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    def graphs(lean_activations):
        torch.manual_seed(0)
        blocks = nn.ModuleList(Block(LlamaConfig(hidden_size=32, intermediate_size=64)) for _ in range(10))
        if lean_activations:
            assert apply_lean_activations(blocks) == 20
        compiled = []

        def backend(gm, inputs):  # one backend for every block, as strategy.compile passes one
            compiled.append(len(gm.graph.nodes))
            return gm.forward

        torch.compiler.reset()
        for block in blocks:
            block.compile(backend=backend)
        x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        for block in blocks:
            x = block(x)
        x.sum().backward()
        return compiled, x.detach()

    (stock, out), (patched, lean_out) = graphs(False), graphs(True)
    torch.compiler.reset()
    assert stock == patched and len(patched) == 1, (stock, patched)
    assert torch.equal(out, lean_out)


def mlp_paths(model):
    """Records, per MLP call, the class of its output's grad_fn: ``_SwiGLUDownBackward`` when the lean path ran."""
    paths = []
    for name, module in model.named_modules():
        if name.endswith("mlp"):
            module.register_forward_hook(lambda m, a, out, name=name: paths.append(
                (name, type(out.grad_fn).__name__ if out.grad_fn is not None else None)) and None)
    return paths


def test_no_grad_and_hooks_fall_back_to_the_original(monkeypatch):
    """Under no_grad (generation, reference log-probs) the lean functions never run; a hook on a projection keeps
    that MLP (only) on the original forward, and the hook runs."""
    model = load_causal_lm(str(TINY_MODEL), lean_activations=False)
    batch = micro_batch()
    stock = model_step(model, batch)
    apply_lean_activations(model)
    calls, paths = [], mlp_paths(model)
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: calls.append(o.shape) and None)
    with monkeypatch.context() as patch:
        patch.setattr(lean, "swiglu_down", lambda *a: pytest.fail("lean MLP ran"))
        patch.setattr(lean, "rms_norm", lambda *a: pytest.fail("lean norm ran"))
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    assert torch.equal(logits, stock[0]) and len(calls) == 1
    paths.clear()
    assert_bitwise(stock, model_step(model, batch))
    assert len(calls) == 2
    assert paths == [("model.layers.0.mlp", "UnsafeViewBackward0"), ("model.layers.1.mlp", "_SwiGLUDownBackward")]


def test_a_deep_copy_of_a_patched_model_is_patched_on_its_own_modules():
    """A reference model deep-copied from the policy carries the patch bound to its own modules, not the policy's."""
    import copy

    model = load_causal_lm(str(TINY_MODEL), lean_activations=False)
    batch = micro_batch()
    stock = model_step(model, batch)
    apply_lean_activations(model)
    twin = copy.deepcopy(model)
    assert sum(isinstance(m, LeanModule) for m in twin.modules()) == 7
    assert_bitwise(stock, model_step(twin, batch))
    assert remove_lean_activations(twin) == 7 and remove_lean_activations(model) == 7


@pytest.mark.parametrize("lean", [True, False])
def test_every_task_has_the_lean_activations_key(lean, parity_env):
    """``model.lm.lean_activations`` (default true) reaches the loader: patched forwards, or the model's own."""
    from functools import partial

    from rl_lightning.models.config import LMConfig
    from rl_lightning.models.lean import LeanModule
    from rl_lightning.rollout.config import RolloutConfig
    from rl_lightning.tasks import DPO, PPO, SFT, RewardModel

    for task in (SFT, DPO, RewardModel, partial(PPO, rollout=RolloutConfig(parity_env))):
        module = task(LMConfig(str(TINY_MODEL), lean_activations=lean))
        module.configure_model()
        patched = sum(isinstance(m, LeanModule) for m in module.model.modules())
        layers = module.model.config.num_hidden_layers
        assert patched == ((3 * layers + 1) if lean else 0), (type(module).__name__, patched)  # 2 norms + MLP per block, final norm
