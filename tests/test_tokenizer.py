"""Tokenizers: round trips, agreement with the reference libraries, streaming decode, chat templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.checkpoints.gguf_file import GGUFFile
from serving.text import chat_templates
from serving.text.tokenizer import HFTokenizer, TiktokenTokenizer, load_tokenizer, tokenizer_from_gguf

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "  leading spaces, trailing spaces  \n\nand\ttabs",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 😀🚀👩‍👩‍👧 and accents: café, naïve, Ærøskøbing",
    "Mixed: The price is ¥ and € — “quotes” ‘single’ …",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_path):
    return tokenizer_from_gguf(GGUFFile(smollm2_path).tokenizer_data())


@pytest.fixture(scope="module")
def llama3_model_path() -> Path:
    import llama_models

    return Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"


@pytest.fixture(scope="module")
def llama3_tokenizer(llama3_model_path):
    return load_tokenizer(llama3_model_path)


@pytest.fixture(scope="module")
def llama3_reference(llama3_model_path):
    from llama_models.llama3.tokenizer import Tokenizer

    return Tokenizer(llama3_model_path)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_round_trips_and_agrees_with_transformers(gguf_tokenizer, smollm2_hf_tokenizer, text):
    ids = gguf_tokenizer.encode(text)
    assert gguf_tokenizer.decode(ids) == text
    assert ids == smollm2_hf_tokenizer.encode(text, add_special_tokens=False)
    assert gguf_tokenizer.decode(ids) == smollm2_hf_tokenizer.decode(ids)


def test_gguf_smollm_pre_tokenizer_splits_digits(gguf_tokenizer):
    """llama.cpp's "smollm" pre-tokenizer (like SmolLM2's tokenizer.json) puts each digit alone."""
    ids = gguf_tokenizer.encode("year 2024")
    assert [gguf_tokenizer.decode([i]) for i in ids[-4:]] == ["2", "0", "2", "4"]
    assert gguf_tokenizer.decode(ids) == "year 2024"


def test_gguf_special_tokens_and_stop_ids(gguf_tokenizer):
    ids = gguf_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == gguf_tokenizer.token_id("<|im_start|>")
    assert gguf_tokenizer.decode(ids) == "user\nhi"
    assert gguf_tokenizer.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"
    assert gguf_tokenizer.token_id("<|im_end|>") in gguf_tokenizer.eos_ids
    assert gguf_tokenizer.add_bos is False


def test_tokenizer_json_agrees_with_transformers(tmp_path, smollm2_hf_tokenizer):
    smollm2_hf_tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tmp_path)
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, HFTokenizer)
    for text in [*TEXTS, "numbers 12345 and <|im_start|>"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.apply_chat_template(CHAT) == reference.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("text", TEXTS)
def test_llama3_tiktoken_agrees_with_meta_reference(llama3_tokenizer, llama3_reference, text):
    assert isinstance(llama3_tokenizer, TiktokenTokenizer)
    ids = llama3_tokenizer.encode_prompt(text)
    assert ids == llama3_reference.encode(text, bos=True, eos=False)
    assert llama3_tokenizer.decode(ids) == text
    assert llama3_reference.decode(ids[1:]) == text


def test_llama3_special_tokens(llama3_tokenizer, llama3_reference):
    assert llama3_tokenizer.vocab_size == llama3_reference.n_words == 128256
    assert llama3_tokenizer.bos_id == llama3_reference.bos_id
    assert set(llama3_tokenizer.eos_ids) == set(llama3_reference.stop_tokens) | {llama3_reference.eos_id}
    assert llama3_tokenizer.encode("<|eot_id|>") == [llama3_reference.eot_id]


def test_llama3_chat_template_matches_meta_chat_format(llama3_tokenizer, llama3_reference):
    from llama_models.datatypes import RawMessage
    from llama_models.llama3.chat_format import ChatFormat

    expected = ChatFormat(llama3_reference).encode_dialog_prompt(
        [RawMessage(role=m["role"], content=m["content"]) for m in CHAT]
    )
    assert llama3_tokenizer.chat_template == chat_templates.LLAMA3
    assert llama3_tokenizer.encode_chat(CHAT) == expected.tokens


def test_builtin_chatml_renders_like_smollm2_own_template(gguf_tokenizer, smollm2_hf_tokenizer):
    for messages in (CHAT, CHAT[1:]):
        builtin = chat_templates.render(
            chat_templates.CHATML, messages, add_generation_prompt=True, bos_token="", eos_token=""
        )
        assert builtin == gguf_tokenizer.apply_chat_template(messages)
        assert builtin == smollm2_hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def _stream(tokenizer, ids):
    decoder = tokenizer.incremental_decoder()
    return [decoder.push(i) for i in ids], decoder.flush()


@pytest.mark.parametrize("which", ["gguf", "llama3"])
def test_incremental_decode_holds_back_partial_characters(which, gguf_tokenizer, llama3_tokenizer):
    tokenizer = gguf_tokenizer if which == "gguf" else llama3_tokenizer
    for text in TEXTS:
        ids = tokenizer.encode(text)
        pieces, tail = _stream(tokenizer, ids)
        assert "".join(pieces) + tail == text
        assert all("\ufffd" not in p for p in pieces)
    # A character split over several byte-level tokens: nothing comes out until it is complete.
    ids = tokenizer.encode("😀")
    assert len(ids) > 1
    pieces, tail = _stream(tokenizer, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "😀"
    assert tail == ""


def test_incremental_decode_of_a_dangling_byte_flushes_a_replacement(llama3_tokenizer):
    first = llama3_tokenizer.encode("😀")[0]
    pieces, tail = _stream(llama3_tokenizer, [first])
    assert pieces == [""]
    assert tail == "\ufffd"


def test_unknown_token_id_is_a_clear_error(gguf_tokenizer):
    from serving.text.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        gguf_tokenizer.decode([10**7])
