"""4-bit base weights (QLoRA) through bitsandbytes: the linear layers of a causal LM stored as
NF4 or FP4 blocks, LoRA adapters trained on top.

QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv
2305.14314) stores each frozen weight matrix in 4 bits, in blocks of 64 values that share
one fp32 scale (absmax); with double quantization those scales are themselves quantized to
8 bits in blocks of 256, around their mean (one fp32 offset and a second-level fp32 scale per
256 blocks): 4.127 bits per weight instead of 4.5. The matmul dequantizes the weight to the
compute dtype (bf16 in the paper) and multiplies; the adapters are ordinary 16/32-bit LoRA.
What batchfit builds is what transformers' `BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type=..., bnb_4bit_use_double_quant=..., bnb_4bit_compute_dtype=...)`
loads (`transformers.integrations.bitsandbytes.replace_with_bnb_linear`: every nn.Linear
but the output head becomes a `bnb.nn.Linear4bit`), then peft's
`prepare_model_for_kbit_training`: every base weight frozen and the weights left in 16 bits
(norms, embeddings, the head) cast to fp32. Activation checkpointing stays trainer.
activation_checkpointing's (non-reentrant: no input gradients needed).

Memory, exactly, on CPU and for CUDA (train/measure/memory.py's tracker counts what is listed
here; the predictor computes the step on fake tensors with bitsandbytes' own fake kernels,
`bitsandbytes/_ops.py`):
- the packed weights (uint8 parameters, two values a byte) and their quantization state,
  which is no parameter nor buffer (`quant_state_tensors`: absmax, the 16-value code, and
  for double quantization the 8-bit absmax, its offset, the second-level scales and code);
- the dequantized weight each matmul makes and frees, forward and backward: bitsandbytes'
  `gemm_4bit` op is one op to a dispatch mode, so the tracker runs it as the composition its
  kernel runs (`unfused_gemm_4bit`): on CPU always, on CUDA where bitsandbytes' own
  heuristic (`_gemm_4bit_use_custom_cuda`, by compute capability, SM count and the shapes)
  picks dequantize-then-matmul over its fused kernel, whose only allocation is the output.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

# model.quantization: bitsandbytes' 4-bit types (BitsAndBytesConfig.bnb_4bit_quant_type)
QUANTIZATIONS = ("none", "nf4", "fp4")
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCKSIZE = 64  # bitsandbytes' 4-bit block (QLoRA's), one absmax per 64 weights
SKIP = ("lm_head",)  # transformers' get_keys_to_not_convert: the output head stays 16/32-bit


def check(quantization: str, lora: Any, compute_dtype: str | None) -> None:
    """A clear error, before anything is built, for a quantization that cannot train."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"model.quantization={quantization!r}: give one of {', '.join(QUANTIZATIONS)} "
            "(bitsandbytes' 4-bit types; none keeps the weights in model.dtype)"
        )
    if quantization == "none":
        return
    if lora is None:
        raise ValueError(
            f"model.quantization={quantization}: 4-bit weights do not train, so full fine-tuning "
            "(model.lora=null) cannot quantize them; give model.lora (QLoRA) or "
            "model.quantization=none"
        )
    if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"model.compute_dtype={compute_dtype!r}: give one of {', '.join(COMPUTE_DTYPES)}, "
            "or null (trainer.precision's autocast dtype, else each layer's input's)"
        )
    try:
        _import_offline()
    except ImportError:
        raise ValueError(
            f'model.quantization={quantization} needs bitsandbytes: pip install -e ".[llm]"'
        ) from None


# bitsandbytes' CPU backend (0.50), imported on a CPU with AVX512-BF16, asks the kernels
# package for this Hub repository's 4-bit kernel, and logs this when it gets none.
_HUB_KERNEL_LOGGER = "bitsandbytes.backends.cpu.ops"
_HUB_KERNEL_FALLBACK = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _import_offline() -> None:
    """Import bitsandbytes without a Hugging Face Hub lookup. On a CPU with AVX512-BF16 its
    CPU backend, as it is imported, fetches `kernels-community/quantization-bitsandbytes`
    through the kernels package (a request to the Hub; offline a failed one, and a third
    party's warning before anything batchfit prints). That kernel speeds up one thing, the
    4-bit matmul of a single row without gradients (`gemv_4bit`: token-by-token inference),
    which no training step runs. Within the import the kernels package cannot be imported,
    as if it were not installed: bitsandbytes keeps its own kernel, and its one log record
    saying so is dropped (and only it: `_NoHubKernel`). Once imported, nothing to do."""
    if "bitsandbytes" in sys.modules:
        return
    saved = sys.modules.get("kernels")
    sys.modules["kernels"] = None  # type: ignore[assignment]  # `import kernels`: ImportError
    quiet = _NoHubKernel()
    logger = logging.getLogger(_HUB_KERNEL_LOGGER)
    logger.addFilter(quiet)
    try:
        import bitsandbytes  # noqa: F401
    finally:
        logger.removeFilter(quiet)
        if saved is None:
            del sys.modules["kernels"]
        else:
            sys.modules["kernels"] = saved


class _NoHubKernel(logging.Filter):
    """Drops bitsandbytes' warning that it loaded no Hub kernel, which _import_offline
    chose; any other record of its logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno == logging.WARNING and str(record.msg).startswith(_HUB_KERNEL_FALLBACK)
        )


@contextmanager
def without_bitsandbytes() -> Iterator[None]:
    """Within: bitsandbytes cannot be imported, as if it were not installed (unless it was
    imported already), for a build with no 4-bit weights: peft imports it wherever it is
    installed (`import peft`: peft/helpers.py; each LoRA layer it makes: its bitsandbytes
    dispatch), and importing it costs a second and may reach for the Hub (_import_offline).
    peft's cached answers to whether bitsandbytes is installed are forgotten on the way out,
    so that a later quantized build in the same process finds it."""
    if "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
            del sys.modules["bitsandbytes"]
        imports = sys.modules.get("peft.import_utils")
        if imports is not None:  # functools caches of whether bitsandbytes is installed
            imports.is_bnb_available.cache_clear()
            imports.is_bnb_4bit_available.cache_clear()


def quantize(
    model: nn.Module,
    quant_type: str,
    double_quant: bool,
    compute_dtype: str | None,
    skip_modules: Sequence[str] = SKIP,
    fp32_upcast: bool = True,
) -> nn.Module:
    """Replace every nn.Linear of `model` but `skip_modules` (the output head, as
    transformers does; a name or its last dotted part) by a bitsandbytes Linear4bit
    holding its weight in `quant_type` blocks, on the device the weight is on (real, meta or
    fake: bitsandbytes' fake kernels give the packed shapes), then, with `fp32_upcast`,
    apply peft's prepare_model_for_kbit_training (without its checkpointing: the
    trainer's): the weights left in 16 bits go to fp32, and with them the residual stream.
    Without it they stay in model.dtype, as litgpt's bf16-true QLoRA keeps them."""
    _import_offline()
    import bitsandbytes as bnb
    from peft import prepare_model_for_kbit_training

    compute = COMPUTE_DTYPES[compute_dtype] if compute_dtype is not None else None
    linears = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    skip = set(skip_modules)
    unknown = sorted(k for k in skip if not any(_named(n, k) for n in linears))
    if unknown:
        raise ValueError(
            f"model.skip_modules: {', '.join(unknown)} names no linear layer of the model; "
            f"its linear layers end in {', '.join(sorted({n.rsplit('.', 1)[-1] for n in linears}))}"
        )
    _real_code_maps()
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or any(_named(name, k) for k in skip):
            continue
        with unset_fake_temporarily():  # its placeholder weight is a Params4bit: not fake
            layer = bnb.nn.Linear4bit(
                module.in_features, module.out_features, module.bias is not None,
                compute_dtype=compute, compress_statistics=double_quant, quant_type=quant_type,
                device="meta",
            )  # fmt: skip
        layer.weight = _quantized(module.weight.detach(), layer, quant_type, double_quant)
        if module.bias is not None:
            layer.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
        # On a CPU with AVX512-BF16, bitsandbytes repacks a layer's weight in place at its
        # first forward without gradients (an evaluation) into an inference-only layout;
        # training after the evaluation would then run on it. Kept in the training layout.
        layer.support_avx512bf16_for_cpu = False
        layer._register_load_state_dict_pre_hook(_load_quantized, with_module=True)
        if compute is None:
            layer.register_forward_pre_hook(_follow_autocast)
        layer.train(module.training)
        model.set_submodule(name, layer)
    model.is_loaded_in_4bit = True  # what transformers sets, and peft reads
    if not fp32_upcast:
        return model.requires_grad_(False)  # frozen, as peft's preparation leaves it
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _follow_autocast(layer: nn.Module, args: tuple) -> None:
    """model.compute_dtype=null: each 4-bit matmul computes in the autocast dtype where the
    step runs under autocast (trainer.precision=bf16: bf16, QLoRA's compute dtype), else in
    its input's dtype. bitsandbytes' own default keeps the dtype of the first input it sees,
    and autocast does not reach its custom op: under peft's fp32 residual stream every
    matmul of a bf16 run would dequantize to fp32 and run in fp32."""
    x, device = args[0], args[0].device.type
    autocast = torch.is_autocast_enabled(device)
    layer.compute_dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    layer.compute_type_is_set = True


def _named(name: str, key: str) -> bool:
    return name == key or name.endswith(f".{key}")


def _load_quantized(layer: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load a saved 4-bit layer (train/model_file.py): bitsandbytes saves the quantization
    state beside the weight (`weight.absmax`, `weight.quant_state.bitsandbytes__nf4`, ...)
    but does not read it back (transformers' from_pretrained does); its
    `Params4bit.from_prequantized` does, here."""
    import bitsandbytes as bnb

    stem = f"{prefix}weight."
    stats = {k[len(stem) :]: state_dict.pop(k) for k in list(state_dict) if k.startswith(stem)}
    if stats and f"{prefix}weight" in state_dict:
        layer.weight = bnb.nn.Params4bit.from_prequantized(
            state_dict[f"{prefix}weight"], stats, device=layer.weight.device, module=layer
        )


def _real_code_maps() -> None:
    """bitsandbytes computes the 8-bit code of double quantization from values (`.tolist()`)
    the first time, then keeps it: computed here on real CPU tensors, so that a model built
    on the meta device or fake tensors (the predictor's) can be quantized."""
    from bitsandbytes import functional

    if "dynamic" not in functional.name2qmap:
        with torch.device("cpu"), unset_fake_temporarily():
            functional.name2qmap["dynamic"] = functional.create_dynamic_map()


def _quantized(weight: torch.Tensor, layer: nn.Module, quant_type: str, double_quant: bool):  # noqa: ANN202
    """`weight` quantized by bitsandbytes: a Params4bit, or for a fake weight (the
    predictor's) a fake Parameter of the shapes bitsandbytes gives, quantized on the meta
    device (a Params4bit cannot wrap a FakeTensor)."""
    import bitsandbytes as bnb

    def params(data: torch.Tensor) -> nn.Parameter:
        return bnb.nn.Params4bit(
            data, requires_grad=False, blocksize=BLOCKSIZE, compress_statistics=double_quant,
            quant_type=quant_type, module=layer,
        )._quantize(data.device)  # fmt: skip

    if not isinstance(weight, FakeTensor):
        return params(weight)
    mode, device = weight.fake_mode, weight.device
    with unset_fake_temporarily():
        meta = params(torch.empty(weight.shape, dtype=weight.dtype, device="meta"))
    fakes: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:
            with mode:
                fakes[id(tensor)] = torch.empty_strided(
                    tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device
                )
        return fakes[id(tensor)]

    param = fake_param(meta, fake(meta))
    layer.quant_state = param.quant_state
    fake_quant_states(layer, fake)
    return param


def quant_states(model: nn.Module) -> Iterator[Any]:
    """The bitsandbytes QuantState of each 4-bit parameter of `model`."""
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        if state is not None:
            yield state


def _state_tensors(state: Any) -> list[torch.Tensor]:
    tensors = [state.absmax, state.code, state.offset]
    if state.state2 is not None:
        tensors += _state_tensors(state.state2)
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of the 4-bit weights' quantization states: alive across steps like the
    parameters, but neither parameters nor buffers."""
    return [t for state in quant_states(model) for t in _state_tensors(state)]


def fake_quant_states(model: nn.Module, fake: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make the quantization states' tensors `fake(tensor)`, in place (the predictor's fake
    model: train/memory/predict.py). A tensor shared by several states stays one."""
    for state in quant_states(model):
        while state is not None:
            for name in ("absmax", "code", "offset"):
                value = getattr(state, name)
                if isinstance(value, torch.Tensor):
                    setattr(state, name, fake(value))
            state = state.state2


def fake_param(param: nn.Parameter, empty: torch.Tensor) -> nn.Parameter:
    """A Parameter over the fake `empty`; of a 4-bit parameter, with its quantization state
    and settings as attributes (a Params4bit cannot wrap a FakeTensor, and bitsandbytes'
    Linear4bit reads no more than these of its weight)."""
    new = nn.Parameter(empty, param.requires_grad)
    if getattr(param, "quant_state", None) is not None:
        for name in ("quant_state", "blocksize", "compress_statistics", "quant_type",
                     "quant_storage", "bnb_quantized", "module"):  # fmt: skip
            setattr(new, name, getattr(param, name))
    return new


# The CUDA card a step is computed for (train/memory/cuda_emulation.py sets it while it
# emulates one): (SM count, compute capability); None on CPU.
_cuda_card: list[tuple[int | None, tuple[int, int]] | None] = [None]


@contextmanager
def cuda_card(sms: int | None, capability: tuple[int, int]) -> Iterator[None]:
    """Within: bitsandbytes' 4-bit matmuls choose their CUDA kernel for this card."""
    saved = _cuda_card[0]
    _cuda_card[0] = (sms, capability)
    try:
        yield
    finally:
        _cuda_card[0] = saved


@functools.cache
def _cuda_heuristic() -> tuple[Callable[..., bool], Any] | None:
    """bitsandbytes' own choice between its fused 4-bit kernel and dequantize + matmul
    (`backends/cuda/ops.py`), with the card's properties given instead of read from a GPU;
    None where the module cannot be imported here."""
    try:
        from bitsandbytes.backends.cuda import ops
    except Exception:  # noqa: BLE001 - no CUDA library for this machine: then unknown
        return None
    return ops._gemm_4bit_use_custom_cuda, ops


def _fused_on_cuda(a: torch.Tensor, shape: Any, blocksize: int) -> bool:
    """Whether bitsandbytes' CUDA kernel for `gemm_4bit` of this call is its fused one (no
    dequantized weight), for the card being emulated. Its rules (bitsandbytes 0.50,
    `bitsandbytes::gemm_4bit` of backends/cuda/ops.py): dequantize + matmul past 1536 rows
    or when the inner dimension is not a multiple of the block; the fused kernel up to 4
    rows; between, its per-architecture heuristic. A card whose SM count is unknown takes
    dequantize + matmul (the larger peak)."""
    card = _cuda_card[0]
    k = a.shape[-1]
    m = a.numel() // k if k else 0
    if card is None or m > 1536 or k % blocksize:
        return False
    sms, (major, minor) = card
    found = _cuda_heuristic()
    if m <= 4:
        return True
    if found is None or sms is None:
        return False
    use_custom, ops = found
    saved = ops._gpu_dispatch_props
    ops._gpu_dispatch_props = lambda index: (sms, major, minor)
    try:
        return bool(use_custom(0, a.dtype, m, int(shape[0]), k))
    finally:
        ops._gpu_dispatch_props = saved


def unfused_gemm_4bit(
    a: torch.Tensor,
    b: torch.Tensor,
    shape: Any,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    bias: torch.Tensor | None = None,
    absmax_8bit: torch.Tensor | None = None,
    absmax_code: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
) -> Any:
    """`bitsandbytes::gemm_4bit` as the composition its kernel runs, for a tracker to count
    its temporaries (the dequantized weight; with double quantization, the dequantized
    scales); NotImplemented where the kernel is the fused one (a CUDA card's, for few rows).
    On CPU the composition is bitsandbytes' default kernel (`_gemm_4bit_default_impl`: the
    dequantized 8-bit scales are freed once the offset is added); on CUDA its
    `_dequant_linear_fallback`, which keeps them until the matmul returns."""
    ops = torch.ops.bitsandbytes
    if a.device.type != "cpu" and not isinstance(a, FakeTensor):
        return NotImplemented  # a real GPU's step: its own kernel, measured by the GPU
    if _cuda_card[0] is None:
        from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

        return _gemm_4bit_default_impl(
            a, b, shape, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code,
            absmax_offset,
        )  # fmt: skip
    if _fused_on_cuda(a, shape, blocksize):
        return NotImplemented
    if absmax_8bit is not None:
        scales = ops.dequantize_blockwise.default(
            absmax_8bit, absmax, absmax_code, 256, torch.float32
        )
        absmax = scales + absmax_offset
    weight = ops.dequantize_4bit.default(b, absmax, blocksize, quant_type, shape, a.dtype)
    return torch.nn.functional.linear(a, weight, bias)


def composites() -> dict[Any, Callable[..., Any]]:
    """Ops a memory tracker runs as their composition (train/measure/memory.py), when
    bitsandbytes is imported."""
    import sys

    if "bitsandbytes" not in sys.modules:
        return {}
    return {torch.ops.bitsandbytes.gemm_4bit.default: unfused_gemm_4bit}
