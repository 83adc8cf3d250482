"""ShadowSync (Zheng et al. 2020) on one machine: a CTR model (DLRM) trained by several Hogwild trainers
whose dense parameters a background "shadow" thread synchronizes. This package holds the data layer
(`data`), the model (`model`), metrics (`metrics`) and configs (`config`); trainers and sync algorithms
build on them."""

from cocosync.shadowsync.config import DataConfig, ModelConfig, SynthConfig

__all__ = ["DataConfig", "ModelConfig", "SynthConfig"]
