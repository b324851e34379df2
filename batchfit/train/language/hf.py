"""Hugging Face causal language models as batchfit models, with LoRA adapters through peft.

    model=hf_causal_lm model.config=llama3_8b           # an architecture of conf/architecture/
    model=hf_causal_lm model.name_or_path=/path/to/ckpt # a local checkpoint (from_pretrained)
    model.lora=null                                     # full fine-tuning: every weight trains

`model.config` names an architecture YAML of conf/architecture/ (its published sizes, no
weights: `AutoModelForCausalLM.from_config`), or is a path to such a YAML (or a JSON) of
one's own, or a checkpoint directory's config. `model.name_or_path` loads a checkpoint from
local files only (nothing is downloaded). Attention runs through PyTorch's SDPA.

`model.lora` (peft's LoraConfig: r, alpha, dropout, target_modules, and any other LoraConfig
field by its own name) freezes the base weights and trains the adapters only; the optimizer
is given the trainable parameters alone (train/build.py). `model.dtype` is what the weights
are stored in (float32, bfloat16, or auto: a checkpoint's own); trainer.precision is the
autocast on top of it.

Under a fake-tensor mode (the memory predictor, the pre-study build check) a checkpoint is
built from its config instead of its files: memory follows the shapes and dtypes, not the
values, so a 70B checkpoint is predicted without reading it.
"""

from __future__ import annotations

import difflib
import json
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from batchfit.common.checks import is_integer, is_number, not_yaml
from batchfit.train.language import quantize

ARCHITECTURES = Path(__file__).resolve().parents[3] / "conf" / "architecture"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# peft's LoraConfig names for the short keys of model.lora; any other key is LoraConfig's own.
LORA_KEYS = {"alpha": "lora_alpha", "dropout": "lora_dropout"}


def architectures() -> list[str]:
    """The names `model.config` takes: the YAMLs of conf/architecture/."""
    return sorted(path.stem for path in ARCHITECTURES.glob("*.yaml"))


def _read_config(config: str | Mapping[str, Any]) -> dict[str, Any]:
    """The settings of `model.config`: a name of conf/architecture/, a YAML or JSON file, a
    checkpoint directory (its config.json), or the settings themselves."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config).expanduser()
    if not path.exists() and (ARCHITECTURES / f"{config}.yaml").exists():
        path = ARCHITECTURES / f"{config}.yaml"
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model.config={config!r} is neither an architecture of conf/architecture/ "
            f"({', '.join(architectures())}) nor a YAML/JSON file or checkpoint directory"
        )
    where = f"model.config={config!r}: {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{where} is not a text file ({error.reason} at byte {error.start}); give a YAML "
            "or JSON architecture"
        ) from None
    if path.suffix == ".json":
        try:
            settings = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{where}:{error.lineno}:{error.colno} is not valid JSON ({error.msg}); "
                "fix the file"
            ) from None
    else:
        from omegaconf import OmegaConf

        try:  # OmegaConf's YAML: 1e-5 is a number, as in conf/
            settings = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
        except yaml.YAMLError as error:
            raise ValueError(
                f"model.config={config!r}: {not_yaml(path, text, error)}; fix the file"
            ) from None
    if not isinstance(settings, dict):
        raise ValueError(
            f"{where} holds no mapping of settings (model_type: llama, hidden_size: ...); "
            "give an architecture like conf/architecture/llama3_tiny.yaml"
        )
    return settings


def architecture(config: str | Mapping[str, Any], vocab_size: int | None = None):  # noqa: ANN201
    """A transformers PretrainedConfig for `model.config`; a vocab_size of null takes the
    data's (`vocab_size`)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    settings = _read_config(config)
    model_type = settings.pop("model_type", None)
    if not model_type:
        raise ValueError(f"model.config={config!r} has no model_type (llama, mistral, qwen2, ...)")
    if settings.get("vocab_size") is None:
        if vocab_size is None:
            raise ValueError(
                f"model.config={config!r} takes its vocab_size from the data, which gives none; "
                "set vocab_size in the architecture or use data=text"
            )
        settings["vocab_size"] = vocab_size
    settings.pop("architectures", None)
    if model_type not in CONFIG_MAPPING:  # its own error lists every type, ~800, on one line
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "e.g. llama, mistral, qwen2"
        raise ValueError(
            f"model.config={config!r}: model_type {model_type!r} is not a model type of "
            f"transformers; {hint}"
        )
    try:
        return AutoConfig.for_model(model_type, **settings)
    except Exception as error:  # noqa: BLE001 - KeyError, ValueError, hf_hub's StrictDataclassError
        lines = str(error).splitlines()
        if not isinstance(error, KeyError | ValueError):
            if "Strict" not in type(error).__name__:
                raise
            lines = lines[1:]  # its validators' errors under a header ("Class validation ...")
        reason = " ".join(line.strip() for line in lines).rstrip(".")
        raise ValueError(f"model.config={config!r}: {reason}; fix the file") from None


def _fake_mode() -> FakeTensorMode | None:
    """The fake-tensor mode being built under, if any (the predictor's, the build check's)."""
    modes = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, FakeTensorMode)]
    return modes[-1] if modes else None


@contextmanager
def eager_on_fakes() -> Iterator[None]:
    """Within: transformers runs its eager code on FakeTensors. It takes a FakeTensor for a
    graph being traced (`is_tracing`: its `is_fake_tensor` check) and then follows its
    export paths, which allocate what the eager step does not: a causal mask materialised
    for SDPA instead of its `is_causal` flag, for one. The memory predictor computes the
    eager step on fakes, so it must see the eager path. Nothing when transformers is not
    imported (no model of it is being predicted)."""
    imports = sys.modules.get("transformers.utils.import_utils")
    masks = sys.modules.get("transformers.masking_utils")
    if imports is None:
        yield
        return
    patches = [(imports, "is_fake_tensor", lambda tensor: False)]
    if masks is not None:
        # The eager path reads the position ids' values to find sequences packed into one
        # row (`.all()` of a tensor), which a fake has none of. The position ids of a
        # predicted step are the model's own arange (the predictor's batches carry none):
        # one sequence per row, what the eager path finds for them. Its temporaries are
        # computed as the eager path computes them, up to the read.
        find = masks.find_packed_sequence_indices

        def unpacked(position_ids: torch.Tensor) -> None:
            with suppress(DataDependentOutputException):
                find(position_ids)

        patches.append((masks, "find_packed_sequence_indices", unpacked))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _dtype(dtype: str, checkpoint_dtype: Any) -> torch.dtype:
    if dtype == "auto":
        if isinstance(checkpoint_dtype, torch.dtype):
            return checkpoint_dtype
        return getattr(torch, str(checkpoint_dtype or "float32"))
    if dtype not in DTYPES:
        raise ValueError(
            f"model.dtype={dtype!r}: the weights are stored in {' or '.join(DTYPES)} (or auto: "
            "a checkpoint's own); float16 weights do not train (use trainer.precision=fp16)"
        )
    return DTYPES[dtype]


class _LoraBound(NamedTuple):
    holds: Callable[[Any], bool]
    what: str  # what the key is
    must: str  # what it must be
    example: str


# model.lora's values that peft refuses at the build (r; its sentence names no key) or that
# train nothing (an alpha of 0 scales the adapters to nothing; a dropout of 1 drops all), by
# peft's names.
_LORA_BOUNDS = {
    "r": _LoraBound(
        lambda v: is_integer(v, 1), "the rank of the LoRA adapters (their inner width)",
        "a positive integer", "8",
    ),
    "lora_alpha": _LoraBound(
        lambda v: is_number(v) and v > 0, "the adapters' output is scaled by alpha / r",
        "a number > 0", "16 (2 x r)",
    ),
    "lora_dropout": _LoraBound(
        lambda v: is_number(v) and 0 <= v < 1, "the probability that an adapter's input is "
        "dropped", "a number in [0, 1)", "0.05 (0.0: none)",
    ),
}  # fmt: skip


def lora_problems(lora: Mapping[str, Any]) -> list[str]:
    """`model.lora`'s values out of `_LORA_BOUNDS`, each named by its key as written (short,
    or peft's own: alpha or lora_alpha), with what it must be and a value that works."""
    problems = []
    for key, value in lora.items():
        bound = _LORA_BOUNDS.get(LORA_KEYS.get(key, key))
        if bound is None or bound.holds(value):
            continue
        shown = "null" if value is None else repr(value)
        problems.append(
            f"model.lora.{key}={shown}: {bound.what}; it must be {bound.must}, e.g. "
            f"model.lora.{key}={bound.example}"
        )
    return problems


def settings_problems(settings: Mapping[str, Any]) -> list[str]:
    """What is wrong in `causal_lm`'s settings (the model node's, resolved) that no build is
    needed to see: train/build.py's check before the first build calls it."""
    lora = settings.get("lora")
    return lora_problems(lora) if isinstance(lora, Mapping) else []


def lora_config(lora: Mapping[str, Any]):  # noqa: ANN201
    """peft's LoraConfig for `model.lora` (short keys r, alpha, dropout, target_modules)."""
    from peft import LoraConfig

    problems = lora_problems(lora)
    if problems:
        raise ValueError("; ".join(problems))
    settings = {LORA_KEYS.get(key, key): value for key, value in lora.items()}
    settings.setdefault("task_type", "CAUSAL_LM")
    try:
        return LoraConfig(**settings)
    except TypeError as error:  # an unknown key
        raise ValueError(
            f"model.lora: {error}; its keys are r, alpha, dropout, target_modules and peft "
            "LoraConfig's own fields"
        ) from None


def causal_lm(
    config: str | Mapping[str, Any] | None = None,
    name_or_path: str | None = None,
    lora: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    vocab_size: int | None = None,
    block_size: int | None = None,
    quantization: str = "none",
    double_quant: bool = True,
    compute_dtype: str | None = None,
    skip_modules: Sequence[str] = quantize.SKIP,
    fp32_upcast: bool = True,
) -> nn.Module:
    """A causal LM of `model.name_or_path` (from_pretrained, local files only) when it is
    set, else of `model.config` (from_config), with LoRA adapters when `lora` is given.
    `vocab_size` and `block_size` (the sequence length) come from the data and are checked
    against the architecture. `quantization` (nf4, fp4) stores the base model's linear
    layers but `skip_modules` in 4 bits, with `double_quant` and `compute_dtype` as
    bitsandbytes', and `fp32_upcast` as peft's preparation (QLoRA:
    train/language/quantize.py)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ValueError(
            'Hugging Face models need transformers and peft: pip install -e ".[llm]"'
        ) from None
    if config is None and name_or_path is None:
        raise ValueError(
            "give model.config (an architecture: "
            f"{', '.join(architectures())}) or model.name_or_path (a local checkpoint)"
        )
    quantize.check(quantization, lora, compute_dtype)
    fake = _fake_mode() is not None
    if name_or_path is not None:
        path = Path(name_or_path).expanduser()
        if not path.is_dir():
            raise ValueError(
                f"model.name_or_path={name_or_path!r} is not a directory; batchfit loads local "
                "checkpoints only (download it first, e.g. `hf download <repo> --local-dir DIR`)"
            )
        arch = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        arch = architecture(config, vocab_size)
    arch.use_cache = False  # a training step keeps no key/value cache
    weights = _dtype(dtype, arch.dtype)
    _check_data(arch, vocab_size, block_size)
    # 4-bit weights are packed from full-precision ones: built on a GPU, all of these would
    # be there at once before the first is packed (16 GB for an 8B model: more than the card
    # QLoRA is for) and their freed blocks would stay in its cache. They are made and packed
    # on the host, and only the packed weights move (train/build.py build_model moves what a
    # builder leaves off its device).
    host = quantization != "none" and torch.empty(0).device.type == "cuda"
    with torch.device("cpu") if host else nullcontext():
        if name_or_path is not None and not fake:
            model = AutoModelForCausalLM.from_pretrained(
                path, config=arch, local_files_only=True, dtype=weights,
                attn_implementation=attn_implementation,
            )  # fmt: skip
        else:  # from the architecture, or a checkpoint's shapes when only memory is wanted
            model = _from_config(AutoModelForCausalLM, arch, weights, attn_implementation, fake)
        if quantization != "none":  # a checkpoint's weights are read, then quantized
            model = quantize.quantize(
                model, quantization, double_quant, compute_dtype, list(skip_modules), fp32_upcast
            )
    if lora is None:
        return model
    # peft imports bitsandbytes wherever it is installed: not for a model without 4-bit layers
    with quantize.without_bitsandbytes() if quantization == "none" else nullcontext():
        return _with_adapters(model, lora)


causal_lm.settings_problems = settings_problems  # type: ignore[attr-defined]  # train/build.py


def _with_adapters(model: nn.Module, lora: Mapping[str, Any]) -> nn.Module:
    from peft import get_peft_model

    settings = lora_config(lora)
    _check_targets(model, settings.target_modules)
    # peft moves each new adapter to its base layer's device with Module.to, which cannot
    # swap a fake tensor's parameters; the adapters are built real (they are small) and the
    # predictor makes them fake with the rest.
    with unset_fake_temporarily(), warnings.catch_warnings():
        # peft reads transformers' deprecated is_gradient_checkpointing (transformers 5)
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        return get_peft_model(model, settings)


def _from_config(auto: Any, arch: Any, dtype: torch.dtype, attention: str, fake: bool) -> nn.Module:
    """`auto.from_config`; a model whose head is tied to its input embedding without the
    head's own weight (`_TiedHead`), where it is built for real (not on meta, not fake)."""

    def build() -> nn.Module:
        return auto.from_config(arch, dtype=dtype, attn_implementation=attention)

    text = arch.get_text_config()
    if fake or not getattr(text, "tie_word_embeddings", False):
        return build()
    device = torch.empty(0).device  # where it is built: the caller's torch.device context
    if device.type == "meta":
        return build()
    states = (
        torch.get_rng_state(),
        torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
    )
    with _TiedHead((text.vocab_size, text.hidden_size), dtype, device) as head:
        model = build()
    if head.replaced is not None and not _tied(model):  # not the head: as transformers builds
        del model
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state_all(states[1])
        model = build()
    return model


def _tied(model: nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    return tied and all(t.device.type != "meta" for t in tensors)


class _TiedHead(TorchFunctionMode):
    """Within: the second (vocab, hidden) weight made, the head that transformers builds
    as a Linear of its own before it ties it to the input embedding (`PreTrainedModel.
    post_init`: `init_weights`, then `tie_weights`), is made on the meta device, and the
    random draws of its initialisation are drawn into a small scratch buffer instead:
    every weight drawn after it (the adapters) gets the numbers it gets without this, and
    the head never holds memory beside the other weights (21% of Llama 3.2 1B's).

    The draws: torch.nn.init's uniform initialisers take one number of the generator per
    element, and its normal ones too, plus 16 when the count is not a multiple of 16 (CPU
    kernels: aten/src/ATen/native/cpu/DistributionTemplates.h `uniform_kernel`,
    `normal_fill`, which fills 16 at a time and recomputes the last 16), so drawing them
    in chunks of a multiple of 16 draws the same. On a GPU the generator's offsets follow
    each launch, so the draws after the head differ from a build with it, as they differ
    from a host build anyway. The caller checks that the tensor replaced was the head (the
    model ends tied, no meta tensor left) and builds it without this otherwise."""

    CHUNK = 2**20  # elements a draw, a multiple of 16

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, device
        self.seen = 0
        self.replaced: torch.Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.empty and self._is_weight(args, kwargs):
            self.seen += 1
            if self.seen == 2:
                self.replaced = func(*args, **{**kwargs, "device": "meta"})
                return self.replaced
        elif self.replaced is not None:  # torch.nn.init passes the tensor by keyword
            tensor = args[0] if args else kwargs.get("tensor")
            name = getattr(func, "__name__", "")
            if self._is_head(tensor) and ("uniform" in name or "normal" in name):
                self._draw("normal" in name and "uniform" not in name)
                return tensor
        return func(*args, **kwargs)

    def _is_weight(self, args: tuple, kwargs: dict) -> bool:
        """Whether torch.empty(*args, **kwargs) makes a tensor of the head's shape."""
        size = args[0] if len(args) == 1 and isinstance(args[0], tuple | list) else args
        return all(isinstance(n, int) for n in size) and torch.Size(size) == self.shape

    def _is_head(self, value: Any) -> bool:
        """The head made here or a Parameter of it: the one meta tensor of its shape (the
        model is built for a real device)."""
        return (
            isinstance(value, torch.Tensor)
            and value.device.type == "meta"
            and value.shape == self.shape
        )

    def _draw(self, normal: bool) -> None:
        """As many draws of the generator as the head's initialiser takes, chunk by chunk."""
        numel = self.shape.numel()
        sizes = [self.CHUNK] * (numel // self.CHUNK)
        rest = numel % self.CHUNK
        if rest >= 16 or not sizes:
            sizes.append(rest)
        elif rest:  # a normal draw of under 16 takes another path: the last chunk takes it
            sizes[-1] += rest
        scratch = torch.empty(max(sizes), dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for size in sizes:
                if normal:
                    scratch[:size].normal_()
                else:
                    scratch[:size].uniform_()


# conf/model/hf_causal_lm.yaml's model.lora.target_modules: Llama-like names, of which a
# model of another family may have some or none; not a list the user wrote.
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _check_targets(model: nn.Module, targets: Any) -> None:
    """Every name of a model.lora.target_modules the user gave names a module of the model,
    as peft matches them (the name, or its last dotted parts). peft refuses a list that
    matches nothing, but a typo beside a valid name (`[q_proj, nosuch_proj]`) would train
    without the adapters it meant, silently. A string (a regex, `all-linear`) is peft's to
    match; the bundled default list is peft's to apply where it can."""
    if targets is None or isinstance(targets, str):  # peft's default for the model, a regex
        return
    if list(targets) == DEFAULT_TARGETS:
        return  # the bundled list, for Llama-like names: peft takes those the model has
    # any module, whatever its type (GPT-2's transformers Conv1D is one peft adapts)
    layers = [name for name, _ in model.named_modules() if name]
    missing = sorted(t for t in targets if not any(n == t or n.endswith(f".{t}") for n in layers))
    if not missing:
        return
    known = sorted(  # the layers with weights of their own, by their last name
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if name
            and next(module.children(), None) is None
            and next(module.parameters(recurse=False), None) is not None
        }
    )
    problems = []
    for target in missing:
        close = difflib.get_close_matches(target, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        problems.append(f"{target} is not a module of the model{hint}")
    raise ValueError(
        f"model.lora.target_modules: {'; '.join(problems)}; its modules: {', '.join(known)}"
    )


def _check_data(arch: Any, vocab_size: int | None, block_size: int | None) -> None:
    if vocab_size is not None and vocab_size > arch.vocab_size:
        raise ValueError(
            f"the data's tokens go up to vocab_size={vocab_size} but the model has "
            f"vocab_size={arch.vocab_size}; use the model's own tokenizer (data.tokenizer)"
        )
    longest = getattr(arch, "max_position_embeddings", None)
    if block_size is not None and longest is not None and block_size > longest:
        raise ValueError(
            f"data.seq_len={block_size} is longer than the model's max_position_embeddings="
            f"{longest}; lower data.seq_len"
        )
