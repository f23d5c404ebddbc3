"""A pytest plugin for diffusers' own test files: unfuse every supported transformer, stand in for Hub downloads.

Load it with `-p plugin` (this folder on `PYTHONPATH`; `run.py` does both). Options:

- `--surgery-unfuse`: every model of a registered family's class is passed through `surgery.unfuse` as soon as it
  exists: after `__init__` (what `from_config` and the tests' `model_class(**init_dict)` call) and after
  `from_pretrained` (which builds the model first and loads the stock checkpoint into it, so the unfuse waits until
  the weights are in). Without the option the plugin only provides the stand-ins (the stock run).
- `--surgery-streams-off`: diffusers' group-offloading tests run on the CPU as they run on an accelerator, with
  `enable_group_offload(use_stream=False, record_stream=False)` (a CPU has no streams) and without their "requires a
  hardware accelerator" / "requires accelerator+PyTorch" skip (the CPU is the onload device); both runs of a comparison take the same option.
- Stand-ins (always on): diffusers' pipeline and LoRA tests read a few tiny tokenizers, configs and text encoders
  from the Hub (`hf-internal-testing/tiny-random-t5`, `-clip`, `-Qwen2VLForConditionalGeneration`). There is no
  Hub here: the plugin builds local folders of the same kind (BPE tokenizers trained on a few sentences, a T5 encoder
  of tiny-random-t5's sizes with seeded weights) once per session and redirects `from_pretrained(<that id>)` to them,
  for the stock and the unfused run alike. Other Hub ids stay unresolved: those tests fail in both runs and the
  runner counts them as "needs the Hub".
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import threading

import pytest

_state = threading.local()
UNFUSED: list[str] = []  # class names of the models unfused in this session (for the runner's report)


def pytest_addoption(parser):
    parser.addoption("--surgery-unfuse", action="store_true", default=False,
                     help="unfuse every registered family's model after it is built or loaded")
    parser.addoption("--surgery-streams-off", action="store_true", default=False,
                     help="group offloading without CUDA streams (use_stream=False, record_stream=False)")


def pytest_configure(config):
    _install_standins()
    if config.getoption("--surgery-unfuse"):
        _install_unfuse()
    if config.getoption("--surgery-streams-off"):
        _install_streams_off()


def pytest_report_header(config):
    mode = "unfused (surgery.unfuse after every build/load)" if config.getoption("--surgery-unfuse") else "stock"
    return f"surgery diffusers-suites plugin: {mode}"


_ACCELERATOR = ("test requires a hardware accelerator", "test requires accelerator+PyTorch")  # new and old mixins


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--surgery-streams-off"):
        return
    for item in items:
        if "group_offloading" in item.name:
            markers = item.iter_markers  # the class's skip mark reaches the item through this (skipping reads it)
            item.iter_markers = lambda name=None, _markers=markers: (
                m for m in _markers(name) if not (m.name == "skipif" and m.kwargs.get("reason") in _ACCELERATOR))


def _install_streams_off() -> None:
    from diffusers import ModelMixin

    enable = ModelMixin.enable_group_offload

    @functools.wraps(enable)
    def enable_group_offload(self, *args, **kwargs):
        return enable(self, *args, **dict(kwargs, use_stream=False, record_stream=False))

    ModelMixin.enable_group_offload = enable_group_offload


# --- unfuse after build / load ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def _loading():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _install_unfuse() -> None:
    import surgery
    from surgery.core.registry import model_class

    classes = []
    for family in surgery.extend.families().values():
        if family.model_class is None or isinstance(family.model_class, str):
            continue
        classes.append(model_class(family))

    for cls in classes:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, _init=init, _cls=cls, **kwargs):
            _init(self, *args, **kwargs)
            # only the outermost constructor of the exact class, and not inside from_pretrained (weights not in yet)
            if type(self) is _cls and not getattr(_state, "depth", 0):
                surgery.unfuse(self)
                UNFUSED.append(_cls.__name__)

        cls.__init__ = __init__

        from_pretrained = cls.from_pretrained.__func__

        @functools.wraps(from_pretrained)
        def _from_pretrained(klass, *args, _fp=from_pretrained, _cls=cls, **kwargs):
            with _loading():
                model = _fp(klass, *args, **kwargs)
            if type(model) is _cls and not getattr(_state, "depth", 0):
                surgery.unfuse(model)
                UNFUSED.append(_cls.__name__)
            return model

        cls.from_pretrained = classmethod(_from_pretrained)


# --- Hub stand-ins ---------------------------------------------------------------------------------------------------

CORPUS = ["a red fox in fresh snow", "a lighthouse on a cliff at dusk", "an oil painting of a quiet harbour",
          "a photo of a cat sitting on a chair", "user assistant system describe the image",
          "A painting of a squirrel eating a burger", "a dog", "pancakes with syrup"] * 4


def _bpe(special: list[str], vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    return bpe


def _t5(folder: str) -> None:
    import torch
    from tokenizers import processors
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    # hf-internal-testing/tiny-random-t5's sizes (d_model 32, 5 layers, 4 heads, vocab 1103)
    config = T5Config(vocab_size=1103, d_model=32, d_kv=8, d_ff=37, num_layers=5, num_heads=4,
                      relative_attention_num_buckets=8, dropout_rate=0.1, decoder_start_token_id=0,
                      eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    T5EncoderModel(config).save_pretrained(folder)
    config.save_pretrained(folder)
    bpe = _bpe(["<pad>", "</s>", "<unk>"])
    bpe.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    T5TokenizerFast(tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                    extra_ids=0).save_pretrained(folder)


def _clip(folder: str) -> None:
    from tokenizers import processors
    from transformers import CLIPTokenizer

    bpe = _bpe(["<|startoftext|>", "<|endoftext|>"])
    bpe.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 0), ("<|endoftext|>", 1)])
    CLIPTokenizer(tokenizer_object=bpe, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                  unk_token="<|endoftext|>", pad_token="<|endoftext|>",
                  model_max_length=77).save_pretrained(folder)


def _qwen2(folder: str) -> None:
    from transformers import Qwen2TokenizerFast

    bpe = _bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"])
    Qwen2TokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                       bos_token=None).save_pretrained(folder)


STANDINS = {
    "hf-internal-testing/tiny-random-t5": _t5,
    "hf-internal-testing/tiny-random-clip": _clip,
    "hf-internal-testing/tiny-random-Qwen2VLForConditionalGeneration": _qwen2,
}


@functools.lru_cache(maxsize=None)
def _standin_root() -> str:
    root = os.environ.get("SURGERY_STANDINS") or tempfile.mkdtemp(prefix="surgery-standins-")
    for repo, build in STANDINS.items():
        folder = os.path.join(root, repo)
        if not os.path.isdir(folder):
            tmp = tempfile.mkdtemp(dir=root)
            build(tmp)
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            os.replace(tmp, folder)
    return root


def _redirect(name):
    if isinstance(name, str) and name in STANDINS:
        return os.path.join(_standin_root(), name)
    return name


def _install_standins() -> None:
    import transformers
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    owners = [PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase,
              transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoProcessor,
              transformers.AutoModel]
    for owner in owners:
        original = owner.__dict__["from_pretrained"]
        func = original.__func__ if isinstance(original, classmethod) else original

        @functools.wraps(func)
        def from_pretrained(klass, name=None, *args, _func=func, **kwargs):
            return _func(klass, _redirect(name), *args, **kwargs)

        setattr(owner, "from_pretrained", classmethod(from_pretrained))


@pytest.fixture(scope="session")
def surgery_standins() -> str:
    return _standin_root()
