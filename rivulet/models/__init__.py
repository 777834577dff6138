from rivulet.models.arch_config import ArchConfig
from rivulet.models.registry import MODEL_REGISTRY, get_model_class

__all__ = ["ArchConfig", "MODEL_REGISTRY", "get_model_class"]
