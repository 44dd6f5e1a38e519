"""A saved adapter served frozen: merged into the base weights once, at start.

With training off, `adapter.dir` (`--adapter-dir`) serves a version the trainer saved
there — the newest that loads, or `adapter.version` — and `adapter.lora_module`
(`--lora-modules name=DIR`) a PEFT adapter directory made elsewhere. Either is merged
into the model's weights (W + B·A·scale, PEFT's `merge_and_unload`) before the engine is
built, so serving runs as fast as the base model: a canary, a rollback, another node.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.adapter_store import AdapterLoadError, AdapterStore
from trainer.config import AdapterConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedAdapter:
    # the directory the weights came from
    path: str
    # the saved version (adapter.dir), or None (a PEFT directory)
    version: int | None
    # the model name it is served under (lora_module), or None (the served model name)
    name: str | None = None


def merge_frozen_adapter(model, config: AdapterConfig):
    """(model with the adapter merged, ServedAdapter), or (model, None) when none is set.
    Raises ValueError when the adapter cannot be loaded or does not fit the model."""
    if not config.lora_module and not config.dir:
        return model, None
    from peft import PeftModel, set_peft_model_state_dict

    from trainer.adapter import peft_deprecation_quieted, peft_model_of

    if config.lora_module:
        name, _, path = config.lora_module.partition("=")
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"--lora-modules {name}={path}: no PEFT adapter there (adapter_config.json missing)")
        try:
            with peft_deprecation_quieted(), _tying_warnings_quieted():
                merged = _untied_where_adapted(PeftModel.from_pretrained(model, path)).merge_and_unload()
        except Exception as exc:  # noqa: BLE001 - a foreign directory may fail in many ways
            raise ValueError(f"--lora-modules {name}={path}: cannot load it onto this model: {exc}") from exc
        logger.info("serving PEFT adapter %s frozen as %r", path, name)
        return merged, ServedAdapter(path, None, name)
    if not Path(config.dir).is_dir():
        raise ValueError(f"--adapter-dir {config.dir}: no such directory")
    store = AdapterStore(config.dir, read_only=True)  # another process may be saving there
    try:
        snapshot = store.load(store.holder_of(config.version)) if config.version >= 0 else store.latest()
    except AdapterLoadError as exc:
        raise ValueError(f"adapter version {config.version} in {config.dir} cannot be served: {exc}") from exc
    if snapshot is None:
        raise ValueError(f"--adapter-dir {config.dir}: no saved adapter version loads there")
    peft_model = peft_model_of(model, snapshot.peft_config)
    result = set_peft_model_state_dict(peft_model, snapshot.weights)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"adapter version {snapshot.version} in {config.dir} does not fit this model "
                         f"(missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})")
    logger.info("serving adapter version %d from %s frozen (merged into the weights)%s", snapshot.version, config.dir,
                f"; it holds version {config.version}'s weights, which gave way to it"
                if 0 <= config.version != snapshot.version else "")
    return _untied_where_adapted(peft_model).merge_and_unload(), ServedAdapter(str(store.path_of(snapshot.version)),
                                                                             snapshot.version)


@contextlib.contextmanager
def _tying_warnings_quieted():
    """Without PEFT's warnings that an adapter on a tied layer complicates merging: the
    merge here unties it first (`_untied_where_adapted`), and logs that it did."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(tie_word_embeddings|no longer tied).*", category=UserWarning)
        yield


def _untied_where_adapted(peft_model):
    """`peft_model` with each adapted layer's base weight its own, where the model ties it
    to another layer's (an adapter on a tied `lm_head` or `embed_tokens`): merging into a
    shared weight would change the other layer too, which PEFT's unmerged adapter does not."""
    from peft.tuners.lora import LoraLayer

    holders = Counter(p.data_ptr() for _, p in peft_model.named_parameters(remove_duplicate=False))
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            if holders[base.weight.data_ptr()] > 1:
                base.weight = torch.nn.Parameter(base.weight.detach().clone(), requires_grad=False)
                logger.info("%s: its weight is tied to another layer's; merged into a copy of its own", name)
    return peft_model
