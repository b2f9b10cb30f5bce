"""Offline pieces for examples/qwen_vl_lora.py: nothing here touches the network.

- `build_tokenizer()`: a word-level `PreTrainedTokenizerFast` over the synthetic vocabulary plus the
  Qwen-VL special tokens (`<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`, `<|video_pad|>`, eos/pad).
- `build_image_processor()`: `Qwen2VLImageProcessorPil` (no torchvision needed) sized so a 56x56 image
  is 4x4 patches of 14 px, i.e. 4 image tokens after the 2x2 merge.
- `build_model()`: a tiny random-weight Qwen2.5-VL whose special-token ids match the tokenizer.
- `ShapesDataset`: learnable image-caption pairs ("a red circle", PIL-drawn) mixed with text-only
  counting samples ("count from three : four five six"), generated on the fly from (seed, index).
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 30)}
SHAPES = ("circle", "square", "triangle")
NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
           "sixteen seventeen eighteen nineteen").split()
IMAGE_SIZE = 56  # px: 4x4 patches of 14 px -> 4 image tokens, the shortest vision sequence that still sees shape
IMAGE_PROMPT = "describe the image :"
EOS, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD, UNK = (
    "<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<unk>")
SPECIALS = (EOS, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD, UNK)  # ids 0..5, in this order
WORDS = ("describe", "the", "image", ":", "a", "count", "from", *COLOURS, *SHAPES, *NUMBERS)
VOCAB_SIZE = 64  # >= len(SPECIALS) + len(WORDS) (= 52); every id the model can emit is a real token


def build_tokenizer():
    """Word-level tokenizer; ids 0..5 are the special tokens (see `SPECIALS`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    assert len(vocab) <= VOCAB_SIZE
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Words are whitespace-separated; the specials are added tokens, matched before splitting.
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=UNK)
    fast.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]})
    for s in SPECIALS:
        assert fast.convert_tokens_to_ids(s) == vocab[s], s
    return fast


def build_image_processor():
    try:  # the PIL backend needs no torchvision; the default class falls back to it with a warning
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:  # pragma: no cover - older transformers
        from transformers import Qwen2VLImageProcessor as ImageProcessor
    pixels = IMAGE_SIZE * IMAGE_SIZE
    return ImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                          size={"shortest_edge": pixels, "longest_edge": pixels})


def build_model(tokenizer, seed: int, hidden: int = 96, layers: int = 2, init_std: float = 0.1):
    """Tiny random Qwen2.5-VL (~0.4M params); `seed` fixes the weights so --resume rebuilds the same base.

    `init_std` 0.1 (not the usual 0.02): the embeddings and LM head stay frozen under LoRA, and a head
    that small caps every logit near 2, so the loss could not fall below ~2.5 however well LoRA learns."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    heads = 4
    half = hidden // heads // 2  # rotary pairs per head, split over (time, height, width) for M-RoPE
    mrope = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=init_std, bos_token_id=None, eos_token_id=ids(EOS), pad_token_id=ids(EOS),
                         rope_scaling={"type": "mrope", "mrope_section": mrope}),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=hidden,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           fullatt_block_indexes=[1], window_size=56),
        image_token_id=ids(IMAGE_PAD), video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START), vision_end_token_id=ids(VISION_END))
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(cfg)


def draw_shape(colour: str, shape: str, rng: random.Random) -> Image.Image:
    """A `shape` in `colour` with random size and position on a grey background."""
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (128, 128, 128))
    d = ImageDraw.Draw(img)
    r = rng.randint(16, 24)  # large and near the centre: the shape's outline spans all 4x4 patches
    c = IMAGE_SIZE // 2
    cx, cy = c + rng.randint(-3, 3), c + rng.randint(-3, 3)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return img


class ShapesDataset:
    """Map-style dataset of {"image": PIL or None, "prompt": str, "answer": str}, generated from (seed, i).

    One sample in `text_every` is text-only, so DDP ranks see both image and image-free batches.
    """

    def __init__(self, size: int, seed: int, text_every: int = 3):
        self.size, self.seed, self.text_every = size, seed, text_every

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.size:
            raise IndexError(i)
        rng = random.Random(self.seed * 1_000_003 + i)
        if i % self.text_every == self.text_every - 1:
            start = rng.randint(0, len(NUMBERS) - 4)
            return {"image": None, "prompt": f"count from {NUMBERS[start]} :",
                    "answer": " ".join(NUMBERS[start + 1:start + 4])}
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        return {"image": draw_shape(colour, shape, rng), "prompt": IMAGE_PROMPT, "answer": f"a {colour} {shape}"}


def chance_level() -> float:
    """Accuracy of guessing over the scored caption words: mean of 1/#colours and 1/#shapes."""
    return (1 / len(COLOURS) + 1 / len(SHAPES)) / 2
