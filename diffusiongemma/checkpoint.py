"""Loading what a command-line run needs from a checkpoint directory: model, tokenizer, chat template,
generation settings. Works on converted directories and on transformers directories (including the
sharded bf16 layout of ``google/diffusiongemma-26B-A4B-it``, converted in memory)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from typing import Any

from diffusiongemma.reference.support.errors import CheckpointError

SHIPPED_MODEL = "tiny-kjv"


def default_model_dir() -> str:
    """Path of the small model shipped with the package (``diffusiongemma/assets/tiny-kjv``)."""
    return str(resources.files("diffusiongemma") / "assets" / SHIPPED_MODEL)


def load_model(path: str, backend: str = "reference", dtype: str = "float32"):
    """The model of ``path`` on ``backend``: "reference" (NumPy), "cpu" (Cython fast path), "gpu" (CuPy),
    "gpu-sim" (the GPU path with its CUDA kernels executed on the CPU, checked: device "cuda-sim"), computing
    in ``dtype``: "float32" (default) or "bfloat16" (upstream's bfloat16 run, docs/SPEC.md §10.1, on every
    backend).

    Raises ``CheckpointError`` for a missing or malformed directory, ``ConfigError`` for another dtype and
    ``RuntimeError`` when the backend is not available here (e.g. the compiled extension is not built, or no
    GPU).
    """
    if backend == "reference":
        from diffusiongemma.reference.model import Model

        return Model.from_pretrained(path, dtype=dtype)
    device = {"cpu": "cpu", "gpu": "cuda", "gpu-sim": "cuda-sim"}[backend]
    return _backend_module(backend).Model.from_pretrained(path, device=device, dtype=dtype)


class CheckpointReplaced(CheckpointError):
    """The checkpoint was replaced (e.g. by ``convert --force``) every time it was read; run again later."""


def _identity(path: str) -> tuple[int, int, int] | None:
    """What changes when ``path`` is replaced: its device, inode and modification time (None when absent)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def load_checkpoint(path: str, backend: str = "reference", attempts: int = 3, dtype: str = "float32"):
    """``(text side, model)`` of ``path``, both from the same version of the checkpoint; the model computes in
    ``dtype`` (``load_model``).

    A directory is opened once and both are read through that handle (``/proc/self/fd/N`` on Linux), so a
    ``convert --force`` that swaps a new checkpoint in meanwhile cannot pair the tokenizer of one version
    with the weights of the other. If the checkpoint at ``path`` changed while it was read (the old one may be
    deleted under the reader, which then fails), the read is retried; after ``attempts`` changed reads,
    ``CheckpointReplaced`` says a replace is in progress. Other errors are those of ``load_text_side`` and
    ``load_model``, naming ``path``.
    """
    for _ in range(attempts):
        before = _identity(path)
        fd, pinned = _pin(path)
        try:
            text_side = load_text_side(pinned)
            model = load_model(pinned, backend, dtype)
        except CheckpointError as exc:
            if _identity(path) != before:
                continue  # replaced mid-read: read the new version
            renamed = _user_path_error(exc, pinned, path)
            if renamed is not None:
                raise renamed from None
            raise
        except Exception as exc:  # ConfigError of config.json, a tokenizer's or an OS error: the user's path too
            renamed = _user_path_error(exc, pinned, path)
            if renamed is not None:
                raise renamed from None
            raise
        finally:
            if fd is not None:
                os.close(fd)
        if _identity(path) == before:
            if text_side.chat_template_source and pinned != path:  # messages name the user's path
                text_side.chat_template_source = text_side.chat_template_source.replace(pinned, path)
            return text_side, model
    raise CheckpointReplaced(f"{path}: a replace is in progress (the checkpoint was replaced while it was being "
                             f"read, {attempts} times in a row: a `convert --force` to it?); run again once it has "
                             "finished")


def _user_path_error(exc: Exception, pinned: str, path: str) -> Exception | None:
    """``exc`` again, of the same type, with the handle's name (``/proc/self/fd/N``) replaced by the user's
    ``path`` in its message; None when the message does not hold the handle's name."""
    text = str(exc)
    if pinned == path or pinned not in text:
        return None
    text = text.replace(pinned, path)
    try:
        renamed = type(exc)(text)
    except Exception:  # noqa: BLE001  (a type that takes other arguments: the project's own kind)
        return CheckpointError(text)
    return renamed if str(renamed) == text else CheckpointError(text)


def _pin(path: str) -> tuple[int | None, str]:
    """(descriptor, a name that keeps resolving to the directory ``path`` names now); files are not pinned."""
    if not os.path.isdir(path):
        return None, path
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None, path
    pinned = f"/proc/self/fd/{fd}"
    if os.path.isdir(pinned) and os.path.samefile(pinned, path):
        return fd, pinned
    os.close(fd)
    return None, path


def _backend_module(backend: str):
    """``diffusiongemma.fast`` (cpu) or ``diffusiongemma.fast.gpu`` (gpu, gpu-sim); RuntimeError when unavailable."""
    try:
        if backend in ("gpu", "gpu-sim"):
            from diffusiongemma.fast import gpu as module
        else:
            from diffusiongemma import fast as module
    except ImportError as exc:  # pragma: no cover - depends on the build
        raise RuntimeError(f"backend {backend!r} failed to import (is the compiled extension built?): {exc}") from exc
    return module


def generate_function(backend: str):
    """The ``generate`` implementation of ``backend`` (same arguments and draw contract everywhere)."""
    if backend == "reference":
        from diffusiongemma.reference.generate import generate

        return generate
    return _backend_module(backend).generate


def load_generation_config(path: str):
    """The checkpoint's generation settings (``GenerationConfig``): ``generation_config.json`` of a directory,
    or the ``diffusion.eb_*`` keys of a GGUF file. Raises ``FileNotFoundError`` when a directory has none."""
    from diffusiongemma.reference.generation_config import GenerationConfig

    if os.path.isfile(path):  # a GGUF file
        from diffusiongemma.weights_converter.gguf import gguf_generation_config

        from diffusiongemma.reference.support.errors import ConfigError

        try:
            return GenerationConfig.from_dict(gguf_generation_config(path))
        except ConfigError as exc:  # the diffusion.eb_* keys carry the generation config's field names
            raise ConfigError(f"{path}: {exc} (GGUF metadata diffusion.eb_*)") from None
    return GenerationConfig.from_pretrained(path)


@dataclass
class TextSide:
    """Tokenizer and chat template of a checkpoint."""

    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None  # Jinja source, or None when the checkpoint has none
    bos_token: str | None
    eos_token: str | None
    chat_template_source: str | None = None  # the file (or GGUF key) the template came from, for messages

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, user_text: str) -> str:
        """Render one user turn plus the generation prompt with the checkpoint's Jinja template
        (sandboxed, like transformers). Raises ``CheckpointError`` ("the checkpoint's chat template failed to
        render: ...") for a template that does not parse or fails while rendering (``raise_exception``, the
        sandbox's limits such as a ``range`` over 100,000 items, a bad operation)."""
        if self.chat_template is None:
            raise CheckpointError("--chat was given but this checkpoint has no chat template "
                                  "(chat_template.jinja or tokenizer_config.json 'chat_template')")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(self.chat_template)
            return template.render(messages=[{"role": "user", "content": user_text}], add_generation_prompt=True,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError,
                MemoryError) as exc:
            # a template is a program: the sandbox refuses a huge range() with OverflowError, a bad filter
            # argument is a TypeError...; each is the template's fault, said in one line
            detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            where = f"{self.chat_template_source}: " if self.chat_template_source else ""
            raise CheckpointError(f"{where}the checkpoint's chat template failed to render: {detail} "
                                  f"({type(exc).__name__})") from None


def load_text_side(path: str) -> TextSide:
    """Tokenizer (``tokenizer.json``, via the ``tokenizers`` library) and chat template of ``path``.

    Raises ``CheckpointError`` when ``tokenizer.json`` is missing or unreadable. For a ``.gguf`` file, the
    ``tokenizer.json`` beside it is used when there is one, else the GGUF's own ``tokenizer.ggml.*`` metadata.
    """
    from tokenizers import Tokenizer

    if os.path.isfile(path):  # a GGUF file
        beside = os.path.dirname(os.path.abspath(path))
        if not os.path.isfile(os.path.join(beside, "tokenizer.json")):
            from diffusiongemma.weights_converter.gguf import gguf_text_side

            return TextSide(*gguf_text_side(path), chat_template_source=f"{path} (tokenizer.chat_template)")
        path = beside
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{path!r} has no tokenizer.json; the command line needs one to turn text into ids")
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as exc:  # the tokenizers library raises a plain Exception on bad files
        detail = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        what = " (its vocabulary is damaged)" if "vocabulary" in detail else ""
        raise CheckpointError(f"{file!r} is not a valid tokenizers file{what}: {detail}") from None
    config: dict = {}
    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config_file):
        try:
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{config_file!r} is not valid UTF-8 JSON: {exc}") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_file!r} must hold a JSON object, got {type(config).__name__}")
    template, source = None, None
    template_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(template_file):
        source = template_file
        try:
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{template_file!r} is not UTF-8 text: {exc}") from None
    else:
        template = _config_template(config.get("chat_template"), config_file)
        source = f"{config_file} (chat_template)" if template is not None else None

    def token(name):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"{config_file!r}: {name} must be a string (or an object with 'content'), "
                                  f"got {value!r:.80}")
        return value

    return TextSide(tokenizer, template, token("bos_token"), token("eos_token"), source)


def _config_template(value: Any, config_file: str) -> str | None:
    """The chat template of ``tokenizer_config.json``: a string, or transformers' list of named templates
    (``[{"name": "default", "template": ...}, ...]``, of which the "default" one is used, as upstream does for
    a plain chat). Raises ``CheckpointError`` naming the file for any other value."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        if "default" in named:
            return named["default"]
        raise CheckpointError(f"{config_file!r}: chat_template lists templates {sorted(named)} but none is named "
                              "'default'")
    raise CheckpointError(f"{config_file!r}: chat_template must be a string or a list of "
                          f"{{'name', 'template'}} objects, got {value!r:.80}")
