"""lowerings/config_text.py: the one text syntax of launch-configuration overrides."""
import pytest

from hyscale_compile.lowerings.config_text import config_name, parse_config_list, parse_fields
from hyscale_compile.lowerings.triton_attention import AttentionConfig
from hyscale_compile.lowerings.triton_attention_backward import BackwardConfig
from hyscale_compile.lowerings.triton_hytopk import HyTopKConfig
from hyscale_compile.lowerings.triton_indexer_kl import IndexerKLConfig


def test_values_by_field_type():
    assert parse_fields(" block_n = 32, prefetch_idx=1,exp2=0 ", AttentionConfig) == dict(
        block_n=32, prefetch_idx=True, exp2=False)
    assert parse_fields("block_m=-64,sort=after,presample_z=2.5,cap=none,reread_weights=1", HyTopKConfig) == dict(
        block_m=-64, sort="after", presample_z=2.5, cap=None, reread_weights=True)
    assert parse_fields("", BackwardConfig) == {}


@pytest.mark.parametrize("item", ["warps=8", "block_n=x", "block_n=", "prefetch_idx=2", "block_n=none", "fused_dq"])
def test_a_bad_item_is_named_with_the_fields(item):
    with pytest.raises(ValueError, match=f"'{item}' is not field=value") as e:
        parse_fields(f"num_warps=8,{item}", BackwardConfig)
    assert "keys_block_g: int" in str(e.value)  # lists the dataclass's fields and types


def test_list_and_round_trip():
    text = "default;dq_heads=2,dk_block_n=128;chunk_rows=64"
    configs = parse_config_list(text, IndexerKLConfig)
    assert configs == [{}, dict(dq_heads=2, dk_block_n=128), dict(chunk_rows=64)]
    assert ";".join(config_name(c) for c in configs) == text
    for cls, text in ((AttentionConfig, "prefetch_idx=1,block_h=16"), (HyTopKConfig, "sort=none,block_m=-64,tma=0")):
        fields = parse_fields(text, cls)
        assert config_name(fields) == text and parse_fields(config_name(fields), cls) == fields
