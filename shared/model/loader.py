"""Build a tenant's model and tokenizer from its :class:`~shared.config.ModelSpec`."""
from __future__ import annotations

import structlog
import torch

from shared.config import ModelSpec
from shared.model.llama import LlamaModel
from shared.model.tokenizer import Tokenizer, load_tokenizer
from shared.model.weights import load_checkpoint

log = structlog.get_logger(__name__)


def build_model(spec: ModelSpec, device: str | torch.device = "cpu") -> tuple[LlamaModel, Tokenizer]:
    """A checkpoint spec loads its directory; a preset/config spec gets seeded random weights (``spec.seed``)."""
    if spec.checkpoint:
        model = load_checkpoint(spec.checkpoint, device, cfg=spec.config)  # the tenant's dtype / context
        source = "checkpoint"
    else:
        model = LlamaModel(spec.config, device, seed=spec.seed)
        source = "random"
    tokenizer = load_tokenizer(spec.checkpoint, model.cfg)
    log.info("model_built", source=source, preset=spec.preset, checkpoint=spec.checkpoint, seed=spec.seed,
             layers=model.cfg.num_hidden_layers, weight_bytes=model.weight_bytes, device=str(device),
             tokenizer=type(tokenizer).__name__)
    return model, tokenizer
