import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.hashing import CHAIN_SEED, EXTRA_SEED, ROOT_PARENT, chain_hashes, hash_block, parse_block_hash


def test_chain_matches_the_documented_formula():
    tokens = list(range(100, 148))
    hashes = chain_hashes(tokens, 16)
    previous = ROOT_PARENT
    for i in range(3):
        block = np.array(tokens[i * 16 : (i + 1) * 16], dtype="<u4").tobytes()
        previous = xxhash.xxh3_128_digest(CHAIN_SEED + previous + block)
        assert hashes[i] == previous
    assert hash_block(hashes[1], tokens[32:48]) == hashes[2]


def test_partial_trailing_block_is_not_keyed():
    assert len(chain_hashes(list(range(47)), 16)) == 2
    assert chain_hashes(list(range(15)), 16) == []


def test_hash_depends_on_the_whole_prefix():
    a = chain_hashes([1] * 16 + [2] * 16, 16)
    b = chain_hashes([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]


def test_incremental_hashing_continues_a_chain():
    tokens = list(range(64))
    full = chain_hashes(tokens, 16)
    assert chain_hashes(tokens[32:], 16, parent=full[1]) == full[2:]


def test_numpy_and_list_inputs_agree():
    tokens = list(range(32))
    assert chain_hashes(np.array(tokens, dtype=np.int64), 16) == chain_hashes(tokens, 16)


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16])
def test_out_of_range_token_ids_are_rejected(bad):
    with pytest.raises(InvalidArgument):
        chain_hashes(bad, 16)


def test_parse_block_hash_round_trip_and_errors():
    h = chain_hashes(list(range(16)), 16)[0]
    assert parse_block_hash(h.hex()) == h
    with pytest.raises(InvalidArgument):
        parse_block_hash("zz")
    with pytest.raises(InvalidArgument):
        parse_block_hash("ab" * 8)


_SCRIPT = "from kvstore.hashing import chain_hashes; print(','.join(h.hex() for h in chain_hashes(list(range(1000)), 16)))"


def test_hashes_are_identical_across_processes_with_different_hash_seeds():
    outputs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True)
        outputs.append(result.stdout.strip())
    assert outputs[0] == outputs[1]
    assert len(outputs[0].split(",")) == 62


def test_extra_keys_follow_the_documented_formula_and_isolate_the_rest_of_the_chain():
    tokens = list(range(64))
    plain = chain_hashes(tokens, 16)
    salted = chain_hashes(tokens, 16, extra_keys=[b"salt:tenant-a", None, None, None])
    first = xxhash.xxh3_128_digest(
        EXTRA_SEED + ROOT_PARENT + np.arange(16, dtype="<u4").tobytes() + xxhash.xxh3_128_digest(b"salt:tenant-a")
    )
    assert salted[0] == first
    assert salted[1] == hash_block(salted[0], tokens[16:32])  # plain blocks after it, chained from it
    assert not set(plain) & set(salted)  # every block of the prompt differs, not only the first
    other = chain_hashes(tokens, 16, extra_keys=[b"salt:tenant-b", None, None, None])
    assert not set(other) & set(salted)
    assert chain_hashes(tokens, 16, extra_keys=[None] * 4) == plain  # no extra keys: the plain chain
    with pytest.raises(InvalidArgument):
        chain_hashes(tokens, 16, extra_keys=[None])
