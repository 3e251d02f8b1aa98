"""router.tokenizer (kvstore/gateway/tokenizer.py): what it tokenizes, and its checks
against the engines' token ids. The real engines' side is in tests/test_router_http.py."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kvstore.config import ConfigError
from kvstore.gateway.config import load_router_config
from kvstore.gateway.tokenizer import CHECK_EVERY, CHECK_FIRST, LocalTokenizer


@pytest.fixture
def tokenizer_file(tmp_path):
    vocab = {"[UNK]": 0, "kv": 1, "cache": 2, "block": 3, "tier": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_it_tokenizes_only_a_single_text_completion_the_engine_tokenizes_whole():
    assert LocalTokenizer.text_of("completion", {"prompt": "kv cache"}) == ("kv cache", True)
    assert LocalTokenizer.text_of("completion", {"prompt": "kv", "add_special_tokens": False}) == ("kv", False)
    for kind, payload in (
        ("chat", {"messages": [{"role": "user", "content": "kv"}]}),  # the engine's chat template decides
        ("completion", {"prompt": ["kv", "cache"]}),  # a batch
        ("completion", {"prompt": [1, 2, 3]}),  # token ids: nothing to tokenize
        ("completion", {"prompt": "kv", "truncate_prompt_tokens": 4}),
        ("completion", {"prompt": "kv", "add_special_tokens": "yes"}),
    ):
        assert LocalTokenizer.text_of(kind, payload) is None, payload


def test_it_is_trusted_after_agreeing_on_the_first_prompts_and_turned_off_by_one_disagreement(tokenizer_file):
    local = LocalTokenizer(str(tokenizer_file.parent))  # the model's directory names its tokenizer.json
    ids = local.encode("kv cache block", add_special_tokens=True)
    assert ids == [1, 2, 3]
    for _ in range(CHECK_FIRST - 1):
        assert local.compare(ids, [1, 2, 3]) and not local.trusted
    assert local.compare(ids, [1, 2, 3]) and local.trusted
    assert [local.check_due() for _ in range(CHECK_EVERY)].count(True) == 1
    assert local.compare_count(3, 3)
    assert not local.compare_count(3, 4)
    assert not local.usable and "3 tokens here was 4 tokens" in local.disagreement
    assert not local.compare(ids, ids)  # off until restarted


def test_a_disagreement_names_where_the_token_ids_part(tokenizer_file):
    local = LocalTokenizer(str(tokenizer_file))
    assert not local.compare([1, 2, 3, 4], [1, 2, 9, 4])
    assert not local.usable and "first differing at position 2" in local.disagreement


def test_a_tokenizer_setting_that_names_no_tokenizer_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.json"):
        LocalTokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a tokenizer file"):
        LocalTokenizer(str(tmp_path))


def test_the_router_reads_its_tokenizer_setting(tmp_path, tokenizer_file):
    path = tmp_path / "router.toml"
    path.write_text(
        f'[router]\nindex = "redis://127.0.0.1:1/0"\ntokenizer = "{tokenizer_file}"\n'
        '[[router.replicas]]\nurl = "http://127.0.0.1:9"\nnode_id = "a"\n'
        '[router.namespace]\nmodel_id = "m"\nnum_layers = 2\nnum_kv_heads = 2\nhead_dim = 64\ndtype = "bfloat16"\nblock_size = 16\n'
    )
    assert load_router_config(path).tokenizer == str(tokenizer_file)
