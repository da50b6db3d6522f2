"""The shipped catalog validates, its pair claims hold by its own facts, and bad files are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from localspec.catalog import (
    Catalog,
    CatalogError,
    ModelEntry,
    load_catalog,
    load_catalog_file,
    vocab_compatibility,
)
from localspec.resources import data_dir
from tests.catalog_toml import tiny_arch


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


def test_builtin_catalog_has_the_issue_models(catalog: Catalog) -> None:
    for size in ("0.5b", "1.5b", "3b", "7b", "14b", "32b"):
        assert f"qwen2.5-coder-{size}" in catalog.models
    assert "qwen3-coder-30b-a3b" in catalog.models
    for size in ("1.5b", "3b", "7b", "14b", "32b"):
        assert catalog.model(f"qwen2.5-coder-{size}").quant_ladder() == [
            "Q4_K_M",
            "Q5_K_M",
            "Q6_K",
            "Q8_0",
        ]
    assert set(catalog.model("qwen2.5-coder-0.5b").quants) == {"Q8_0"}
    assert {m.id for m in catalog.drafts()} >= {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}


def test_q8_0_of_base_models_comes_from_ggml_org(catalog: Catalog) -> None:
    for size in ("0.5B", "1.5B", "3B", "7B", "14B"):
        quant = catalog.model(f"qwen2.5-coder-{size.lower()}").quants["Q8_0"]
        assert quant.repo == f"ggml-org/Qwen2.5-Coder-{size}-Q8_0-GGUF"
        assert quant.main_file.filename == f"qwen2.5-coder-{size.lower()}-q8_0.gguf"


def test_architecture_numbers_match_the_reference_table(catalog: Catalog) -> None:
    # (layers, n_embd, heads, kv heads, head_dim, vocab, tied) from models-and-fit.md
    table = {
        "qwen2.5-coder-0.5b": (24, 896, 14, 2, 64, 151936, True),
        "qwen2.5-coder-1.5b": (28, 1536, 12, 2, 128, 151936, True),
        "qwen2.5-coder-3b": (36, 2048, 16, 2, 128, 151936, True),
        "qwen2.5-coder-7b": (28, 3584, 28, 4, 128, 152064, False),
        "qwen2.5-coder-14b": (48, 5120, 40, 8, 128, 152064, False),
        "qwen2.5-coder-32b": (64, 5120, 40, 8, 128, 152064, False),
        "qwen3-coder-30b-a3b": (48, 2048, 32, 4, 128, 151936, False),
    }
    for model_id, row in table.items():
        a = catalog.model(model_id).arch
        got = (a.n_layer, a.n_embd, a.n_head, a.n_head_kv, a.head_dim, a.n_vocab)
        assert (*got, a.tied_embeddings) == row, model_id
    # KV f16 per token: 7B 56 KiB, 32B 256 KiB (models-and-fit.md)
    assert catalog.model("qwen2.5-coder-7b").arch.kv_bytes_per_token() == 56 * 1024
    assert catalog.model("qwen2.5-coder-32b").arch.kv_bytes_per_token() == 256 * 1024
    assert catalog.model("qwen3-coder-30b-a3b").arch.n_expert_used == 8


def _facts_say_compatible(target: ModelEntry, draft: ModelEntry) -> bool:
    """The rule restated from the catalog's own facts, independently of catalog.py."""
    t, d = target.tokenizer, draft.tokenizer
    return (
        t.model == d.model
        and abs(target.arch.n_vocab - draft.arch.n_vocab) <= 128
        and t.family == d.family
        and t.add_bos == d.add_bos
        and t.add_eos == d.add_eos
    )


def test_every_pair_is_compatible_by_the_catalogs_own_facts(catalog: Catalog) -> None:
    assert catalog.pairs
    for pair in catalog.pairs.values():
        target = catalog.model(pair.target)
        assert target.can_target
        if pair.draft is None:
            assert pair.compatible, pair.id
            continue
        draft = catalog.model(pair.draft)
        assert draft.can_draft
        assert pair.compatible == _facts_say_compatible(target, draft), pair.id
        assert pair.compatible == vocab_compatibility(target, draft)[0], pair.id
    assert catalog.pair("qwen2.5-coder-7b+0.5b").compatible
    assert not catalog.pair("qwen3-coder-30b-a3b+0.5b").compatible
    assert catalog.pair("qwen3-coder-30b-a3b+ngram").draft is None
    assert {p.id for p in catalog.pairs_for("qwen3-coder-30b-a3b")} == {"qwen3-coder-30b-a3b+ngram"}


def test_vocab_rule_reasons() -> None:
    cat = load_catalog()
    ok, reason = vocab_compatibility(
        cat.model("qwen3-coder-30b-a3b"), cat.model("qwen2.5-coder-0.5b")
    )
    assert not ok and "token texts differ" in reason
    big = cat.model("qwen2.5-coder-7b")
    padded = big.model_copy(update={"arch": big.arch.model_copy(update={"n_vocab": 152193})})
    ok, reason = vocab_compatibility(padded, cat.model("qwen2.5-coder-0.5b"))
    assert not ok and "differ by 257" in reason


GOOD_MODEL = f"""
[models.mine]
family = "qwen2.5-coder"
role = "target"
params_b = 1.5
{tiny_arch("mine")}[models.mine.tokenizer]
family = "qwen2.5"
[models.mine.quants.F32]
files = [{{ filename = "mine.gguf", path = "weights/mine.gguf" }}]
"""


def _write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text)
    return path


def test_error_names_file_entry_and_key(tmp_path: Path) -> None:
    bad = _write(tmp_path, "bad.toml", GOOD_MODEL.replace("n_layer = 2\n", ""))
    with pytest.raises(CatalogError) as err:
        load_catalog([tmp_path], builtin=False)
    message = str(err.value)
    assert str(bad) in message and "models.'mine'" in message and "'arch.n_layer'" in message


def test_unknown_key_is_rejected_with_its_name(tmp_path: Path) -> None:
    _write(tmp_path, "typo.toml", GOOD_MODEL.replace("params_b", "param_b"))
    with pytest.raises(CatalogError, match=r"key 'param_b': Extra inputs"):
        load_catalog([tmp_path], builtin=False)


def test_bad_sha256_and_bad_toml_are_named(tmp_path: Path) -> None:
    text = GOOD_MODEL.replace('path = "weights/mine.gguf"', 'path = "w.gguf", sha256 = "abc"')
    _write(tmp_path / "a", "sha.toml", text)
    with pytest.raises(CatalogError, match=r"'quants.F32.files.0.sha256'"):
        load_catalog([tmp_path / "a"], builtin=False)
    broken = _write(tmp_path / "b", "broken.toml", "[models.x\n")
    with pytest.raises(CatalogError, match="not valid TOML") as err:
        load_catalog([tmp_path / "b"], builtin=False)
    assert str(broken) in str(err.value)


def test_quant_needs_a_repo_or_local_paths(tmp_path: Path) -> None:
    _write(tmp_path, "nosrc.toml", GOOD_MODEL.replace(', path = "weights/mine.gguf"', ""))
    with pytest.raises(CatalogError, match=r"'quants.F32': Value error, needs a 'repo'"):
        load_catalog([tmp_path], builtin=False)


def test_size_bytes_must_agree_with_exact_file_sizes(tmp_path: Path) -> None:
    text = GOOD_MODEL.replace(
        'path = "weights/mine.gguf" }]', 'path = "weights/mine.gguf", size = 10 }]\nsize_bytes = 11'
    )
    _write(tmp_path, "sizes.toml", text)
    with pytest.raises(CatalogError, match=r"'quants.F32': Value error, size_bytes 11 != .*\(10\)"):
        load_catalog([tmp_path], builtin=False)


def test_profile_adds_local_model_and_overrides_builtin(tmp_path: Path) -> None:
    override = """
[models."qwen2.5-coder-0.5b".quants.Q8_0]
repo = "corp-mirror/qwen-0.5b"
files = [{ filename = "q.gguf" }]
"""
    profile = tmp_path / "profile"
    _write(profile, "mine.toml", GOOD_MODEL + '\n[pairs."mine+0.5b"]\ntarget = "mine"\n')
    builtin = (data_dir("models") / "qwen2.5-coder.toml").read_text()
    # an override replaces the whole entry: copy the builtin one, then change its Q8_0 repo
    start = builtin.index('[models."qwen2.5-coder-0.5b"]')
    end = builtin.index('[models."qwen2.5-coder-1.5b"]')
    entry = builtin[start:end].split('[models."qwen2.5-coder-0.5b".quants.Q8_0]')[0]
    _write(profile, "override.toml", entry + override)
    cat = load_catalog([profile])
    mine = cat.model("mine")
    assert mine.quants["F32"].main_file.path == str((profile / "weights/mine.gguf").resolve())
    assert mine.source == str(profile / "mine.toml")
    assert cat.model("qwen2.5-coder-0.5b").quants["Q8_0"].repo == "corp-mirror/qwen-0.5b"
    assert cat.pair("mine+0.5b").draft is None  # n-gram only
    assert "qwen2.5-coder-7b" in cat.models  # builtin entries remain


def test_wrong_compatibility_claim_is_a_load_error(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "pairs.toml",
        '[pairs.bad]\ntarget = "qwen3-coder-30b-a3b"\ndraft = "qwen2.5-coder-0.5b"\n'
        "compatible = true\n",
    )
    with pytest.raises(CatalogError, match=r"pairs.'bad': key 'compatible'.*token texts differ"):
        load_catalog([tmp_path])


def test_pair_naming_an_unknown_model(tmp_path: Path) -> None:
    _write(tmp_path, "p.toml", '[pairs.p]\ntarget = "qwen2.5-coder-7bb"\n')
    with pytest.raises(CatalogError, match=r"key 'target'.*did you mean qwen2.5-coder-7b"):
        load_catalog([tmp_path])


def test_duplicate_id_in_one_directory(tmp_path: Path) -> None:
    _write(tmp_path, "a.toml", GOOD_MODEL)
    _write(tmp_path, "b.toml", GOOD_MODEL)
    with pytest.raises(CatalogError, match="also defined in"):
        load_catalog([tmp_path], builtin=False)


def test_unknown_ids_suggest_close_matches(catalog: Catalog) -> None:
    with pytest.raises(CatalogError, match=r"did you mean qwen2\.5-coder-7b"):
        catalog.model("qwen2.5-coder-7")
    with pytest.raises(CatalogError, match="unknown pair"):
        catalog.pair("nope")


REFRESH_ENTRY = f"""# a maintainer's header comment survives
schema_version = 1

[models.tiny]
family = "qwen2.5-coder"
role = "both"
params_b = 0.1
note = "kept as is"
{tiny_arch("tiny")}[models.tiny.tokenizer]
family = "qwen2.5"
[models.tiny.quants.Q8_0]
repo = "acme/Tiny-GGUF"
size_bytes = 5
files = [{{ filename = "tiny-00001-of-00002.gguf" }}, {{ filename = "tiny-00002-of-00002.gguf" }}]
[models.tiny.quants.F16]
repo = "acme/Tiny-GGUF"
files = [{{ filename = "tiny-f16.gguf" }}]
"""


def test_refresh_pins_revision_sizes_and_sha256_from_the_hub(tmp_path: Path) -> None:
    import hashlib

    from localspec.catalog_refresh import refresh_catalog
    from tests.hubserver import LocalHub

    path = _write(tmp_path, "tiny.toml", REFRESH_ENTRY)
    shard1, shard2 = b"a" * 1000, b"b" * 234
    with LocalHub() as hub:
        hub.add_file("acme/Tiny-GGUF", "tiny-00001-of-00002.gguf", shard1)
        hub.add_file("acme/Tiny-GGUF", "tiny-00002-of-00002.gguf", shard2)
        commit = hub.repos["acme/Tiny-GGUF"].commit
        changes = refresh_catalog(path, endpoint=hub.url)
        assert {(c.entry, c.key) for c in changes if c.kind == "updated"} == {
            ("models.tiny.quants.Q8_0", "revision"),
            ("models.tiny.quants.Q8_0", "size_bytes"),
            ("models.tiny.quants.Q8_0", "files.tiny-00001-of-00002.gguf.size"),
            ("models.tiny.quants.Q8_0", "files.tiny-00001-of-00002.gguf.sha256"),
            ("models.tiny.quants.Q8_0", "files.tiny-00002-of-00002.gguf.size"),
            ("models.tiny.quants.Q8_0", "files.tiny-00002-of-00002.gguf.sha256"),
            ("models.tiny.quants.F16", "revision"),
        }
        missing = [c for c in changes if c.kind == "missing"]
        assert [c.key for c in missing] == ["files.tiny-f16.gguf"] and "not in the repo" in str(
            missing[0]
        )
        text = path.read_text()
        assert text.startswith("# a maintainer's header comment survives\n")
        models, _ = load_catalog_file(path)
        quant = models["tiny"].quants["Q8_0"]
        assert quant.revision == commit
        assert [f.size for f in quant.files] == [1000, 234] and quant.size_bytes == 1234
        assert quant.files[1].sha256 == hashlib.sha256(shard2).hexdigest()
        assert models["tiny"].note == "kept as is"
        # a second run finds nothing new; a moved main leaves pinned revisions alone
        assert [c for c in refresh_catalog(path, endpoint=hub.url) if c.kind == "updated"] == []
        hub.add_file("acme/Tiny-GGUF", "tiny-00002-of-00002.gguf", b"c" * 10, commit="f" * 40)
        hub.repos["acme/Tiny-GGUF"].commit = "f" * 40
        moved = refresh_catalog(path, endpoint=hub.url, update_revisions=True, dry_run=True)
        assert ("revision", commit, "f" * 40) in {(c.key, c.old, c.new) for c in moved}
        assert path.read_text() == text  # dry run writes nothing


def test_instruct_models_serve_chat_with_the_05b_instruct_draft(catalog: Catalog) -> None:
    for size in ("0.5b", "1.5b", "3b", "7b", "14b", "32b"):
        model = catalog.model(f"qwen2.5-coder-{size}-instruct")
        assert model.capabilities == ("chat",) and not model.can("fim")
        assert model.tokenizer.eos_id == 151645  # <|im_end|>, as the instruct GGUFs have it
        base = catalog.model(f"qwen2.5-coder-{size}").arch
        assert model.arch == base  # the same architecture as the base model
        assert catalog.pair_can(f"qwen2.5-coder-{size}-instruct+ngram", "chat")
    assert catalog.model("qwen2.5-coder-0.5b-instruct").can_draft
    for size in ("1.5b", "3b", "7b", "14b", "32b"):
        pair = catalog.pair(f"qwen2.5-coder-{size}-instruct+0.5b")
        assert pair.draft == "qwen2.5-coder-0.5b-instruct" and pair.compatible
    both = catalog.model("qwen3-coder-30b-a3b")
    assert both.can("fim") and both.can("chat")
    assert all(catalog.model(f"qwen2.5-coder-{s}").capabilities == ("fim",) for s in ("7b", "32b"))
