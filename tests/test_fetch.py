"""Downloads with the real huggingface_hub client against a local hub on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants  # noqa: F401 - read before a test sets HF_HUB_OFFLINE
import pytest

from localspec import fetch
from localspec.catalog import load_catalog
from localspec.fetch import (
    FetchError,
    FileSpec,
    OfflineError,
    VerifyError,
    model_status,
    pull,
    resolve_local,
)
from localspec.settings import HubSettings, Settings, SettingsError, check_security
from tests.catalog_toml import tiny_arch
from tests.hubserver import LocalHub

REPO = "acme/Tiny-Coder-GGUF"
NAME = "tiny-coder-q8_0.gguf"
SIZE = 3 * 1024 * 1024 + 17
CHUNK = fetch.hub.DOWNLOAD_CHUNK  # what a cut-off download keeps: whole chunks


def gguf_bytes(seed: int, n: int) -> bytes:
    """``n`` random bytes that begin as a GGUF file does."""
    return fetch.hub.GGUF_MAGIC + random.Random(seed).randbytes(n - len(fetch.hub.GGUF_MAGIC))


DATA = gguf_bytes(5, SIZE)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def hub() -> Iterator[LocalHub]:
    with LocalHub() as h:
        h.add_file(REPO, NAME, DATA)
        yield h


@pytest.fixture
def models(tmp_path: Path) -> Path:
    return tmp_path / "models"


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub that stays down is tried again after 0.05 s, not the seconds a user waits."""
    monkeypatch.setattr(fetch.hub, "RETRY_DELAYS_S", (0.05, 0.05, 0.05))


def spec(**kw: object) -> FileSpec:
    return FileSpec(filename=NAME, repo=REPO, **kw)  # type: ignore[arg-type]


def test_fresh_pull_shows_progress_and_lands_in_the_layout(
    hub: LocalHub, models: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (path,) = pull([spec()], models_dir=models, endpoint=hub.url, token="hf_secret")
    assert path == models / "acme" / "Tiny-Coder-GGUF" / "main" / NAME
    assert path.read_bytes() == DATA
    assert hub.bytes_served(NAME) == SIZE
    assert all(r.authorization == "Bearer hf_secret" for r in hub.requests)
    record = path.with_name(NAME + ".verified.json")
    assert SHA in record.read_text()
    assert not path.with_name(NAME + ".partial").exists()
    err = capfd.readouterr().err
    assert "0 of 1 files present; fetching 1" in err  # the overall line
    assert NAME in err and "MB" in err and "/s" in err  # the per-file bar: size, speed
    assert "all 1 files verified" in err


def test_files_present_make_zero_requests_and_no_rehash(
    hub: LocalHub, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (first,) = pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    hub.reset_counts()

    def no_hashing(*args: object, **kw: object) -> str:
        raise AssertionError("a recorded file was hashed again")

    for module in (fetch.files, fetch.hub):  # where it is defined and where pull calls it
        monkeypatch.setattr(module, "sha256_file", no_hashing)
    (again,) = pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    assert again == first
    assert hub.requests == []
    assert resolve_local(spec(), models_dir=models) == first


def test_changed_mtime_is_rechecked_against_the_hub_without_download(
    hub: LocalHub, models: Path
) -> None:
    (path,) = pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    os.utime(path, ns=(1, 1))  # the record no longer matches: the file must be hashed again
    assert resolve_local(spec(), models_dir=models) is None  # unpinned: needs the hub's sha
    hub.reset_counts()
    (again,) = pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    assert again == path
    assert hub.bytes_served() == 0  # metadata only
    assert {r.method for r in hub.requests} <= {"HEAD", "POST"}
    assert resolve_local(spec(), models_dir=models) == path


def test_cut_off_download_resumes_with_a_range_request(hub: LocalHub, models: Path) -> None:
    # a file of a few chunks, cut inside the second
    big_name, chunk = "big-q4_k_m.gguf", CHUNK
    big = gguf_bytes(7, 2 * chunk + 12345)
    hub.add_file(REPO, big_name, big)
    hub.cut(big_name, at=chunk + chunk // 2)
    with pytest.raises(FetchError, match="run the same command again to resume"):
        pull([FileSpec(big_name, REPO)], models_dir=models, endpoint=hub.url, progress=False)
    final = models / "acme" / "Tiny-Coder-GGUF" / "main" / big_name
    partial = final.with_name(big_name + ".partial")
    assert not final.exists()
    kept = partial.stat().st_size
    assert kept == chunk
    hub.heal()
    hub.reset_counts()
    (path,) = pull([FileSpec(big_name, REPO)], models_dir=models, endpoint=hub.url)
    served = hub.bytes_served(big_name)
    assert served < len(big)
    assert served == len(big) - kept
    assert [r.range for r in hub.requests if r.method == "GET"] == [f"bytes={kept}-"]
    assert path.read_bytes() == big
    assert not partial.exists()


def test_a_link_that_drops_every_few_chunks_still_gets_the_file(
    hub: LocalHub, models: Path
) -> None:
    # a VPN that resets every connection after 1.5 MiB: each try keeps what it got
    big_name, mib = "flaky-q4_k_m.gguf", 1 << 20
    big = gguf_bytes(11, 3 * mib + 99)
    hub.add_file(REPO, big_name, big)
    hub.flaky[big_name] = mib + mib // 2
    (path,) = pull([FileSpec(big_name, REPO)], models_dir=models, endpoint=hub.url, progress=False)
    assert path.read_bytes() == big
    gets = [r.range for r in hub.requests if r.method == "GET"]
    assert gets[0] is None and len(gets) <= 4  # the retries huggingface_hub makes itself


def test_a_login_page_in_place_of_the_file_is_discarded_not_resumed(
    hub: LocalHub, models: Path
) -> None:
    hub.portal.add(NAME)
    with pytest.raises(FetchError, match=r"not a GGUF file .*b'<!DOCTYPE html>") as err:
        pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    assert "resume" not in str(err.value)
    partial = models / "acme" / "Tiny-Coder-GGUF" / "main" / (NAME + ".partial")
    assert not partial.exists()
    # a page left by an older run is not resumed either: the file comes whole, once
    partial.write_bytes(b"<!DOCTYPE html>")
    hub.heal()
    hub.reset_counts()
    (path,) = pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    assert path.read_bytes() == DATA
    assert [r.range for r in hub.requests if r.method == "GET"] == [None]


def test_a_models_directory_that_cannot_be_written_is_a_clear_error(
    hub: LocalHub, tmp_path: Path
) -> None:
    blocked = tmp_path / "models"
    blocked.write_text("a file where the models directory should be")
    with pytest.raises(FetchError) as err:
        pull([spec()], models_dir=blocked, endpoint=hub.url, progress=False)
    assert NAME in str(err.value) and "LOCALSPEC_MODELS_DIR" in str(err.value)
    assert str(blocked) in str(err.value)


def test_offline_a_file_changed_since_its_check_is_checked_again(
    hub: LocalHub, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (path,) = pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched, the same bytes
    assert pull([spec()], models_dir=models, progress=False) == [path]
    damaged = bytearray(DATA)
    damaged[SIZE // 2] ^= 0xFF
    path.write_bytes(damaged)  # one flipped byte, the same size
    with pytest.raises(OfflineError, match=f"{path} is there but fails its sha256 check"):
        pull([spec()], models_dir=models, progress=False)


def test_resume_ignored_by_the_server_restarts_cleanly(hub: LocalHub, models: Path) -> None:
    """A server answering 200 to a Range request: the partial is rewound, hash included."""
    big_name, chunk = "big-q5_k_m.gguf", CHUNK
    big = gguf_bytes(8, chunk + 4321)
    hub.add_file(REPO, big_name, big)
    hub.cut(big_name, at=chunk + 100)
    with pytest.raises(FetchError, match="resume"):
        pull([FileSpec(big_name, REPO)], models_dir=models, endpoint=hub.url, progress=False)
    hub.heal()
    hub.ignore_range = True
    hub.reset_counts()
    (path,) = pull([FileSpec(big_name, REPO)], models_dir=models, endpoint=hub.url)
    assert path.read_bytes() == big
    assert hub.bytes_served(big_name) == len(big)
    assert [r.range for r in hub.requests if r.method == "GET"] == [f"bytes={chunk}-"]
    assert (
        hashlib.sha256(big).hexdigest() in path.with_name(big_name + ".verified.json").read_text()
    )


def test_corrupted_download_is_rejected_and_the_previous_good_file_kept(
    hub: LocalHub, models: Path
) -> None:
    (good,) = pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    before = good.stat().st_mtime_ns
    hub.corrupt.add(NAME)
    with pytest.raises(VerifyError) as err:
        pull([spec()], models_dir=models, endpoint=hub.url, progress=False, force=True)
    message = str(err.value)
    assert f"sha256 {SHA}" in message  # expected
    assert "got 3145745 bytes sha256 " in message  # actual
    assert "previous copy" in message
    assert good.read_bytes() == DATA and good.stat().st_mtime_ns == before
    assert not good.with_name(NAME + ".partial").exists()
    hub.reset_counts()
    assert pull([spec()], models_dir=models, endpoint=hub.url, progress=False) == [good]
    assert hub.requests == []


def test_corrupted_fresh_download_leaves_no_file(hub: LocalHub, models: Path) -> None:
    hub.corrupt.add(NAME)
    with pytest.raises(VerifyError, match="failed verification"):
        pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    directory = models / "acme" / "Tiny-Coder-GGUF" / "main"
    assert [p.name for p in directory.iterdir()] == []


def test_pinned_sha256_disagreeing_with_the_hub_fails_before_downloading(
    hub: LocalHub, models: Path
) -> None:
    with pytest.raises(VerifyError, match="catalog pins 0000"):
        pull([spec(sha256="0" * 64)], models_dir=models, endpoint=hub.url, progress=False)
    assert hub.bytes_served() == 0


def test_offline_missing_file_names_it_and_how_to_get_it(
    hub: LocalHub, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(OfflineError) as err:
        pull([spec()], models_dir=models, endpoint=hub.url, offline=True)
    message = str(err.value)
    assert NAME in message and REPO in message and "localspec pull" in message
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineError, match="HF_HUB_OFFLINE"):
        pull([spec()], models_dir=models, endpoint=hub.url)
    # every missing file is named at once; a damaged copy is called damaged, not missing
    damaged = models / "acme" / "Tiny-Coder-GGUF" / "main" / NAME
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"\0" * SIZE)
    with pytest.raises(OfflineError) as err:
        pull([spec(sha256=SHA), FileSpec("draft.gguf", "acme/Draft")], models_dir=models)
    assert "2 model file(s)" in str(err.value) and "draft.gguf (repo acme/Draft" in str(err.value)
    assert f"{damaged} is there but fails its sha256 check" in str(err.value)
    assert hub.requests == []


def test_offline_with_files_present_works(
    hub: LocalHub, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (path,) = pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    hub.reset_counts()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert pull([spec()], models_dir=models, progress=False) == [path]
    assert hub.requests == []


def test_hf_endpoint_environment_is_honoured(
    hub: LocalHub, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    (path,) = pull([spec()], models_dir=models, progress=False)
    assert path.read_bytes() == DATA
    assert hub.bytes_served(NAME) == SIZE


def test_readonly_provisioned_directory_is_searched_first(
    hub: LocalHub, tmp_path: Path, models: Path
) -> None:
    it_dir = tmp_path / "it"
    provisioned = it_dir / "acme" / "Tiny-Coder-GGUF" / "main" / NAME
    provisioned.parent.mkdir(parents=True)
    provisioned.write_bytes(DATA)
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / NAME).write_bytes(DATA)
    pinned = spec(sha256=SHA, size=SIZE)
    assert pull([pinned], models_dir=models, readonly_dirs=[it_dir], progress=False) == [
        provisioned
    ]
    assert pull([pinned], models_dir=models, readonly_dirs=[flat], progress=False) == [flat / NAME]
    assert hub.requests == []
    # without a pinned sha256 the hub's LFS sha256 decides, still without a download
    assert pull([spec()], models_dir=models, readonly_dirs=[it_dir], endpoint=hub.url) == [
        provisioned
    ]
    assert hub.bytes_served() == 0


def test_damaged_provisioned_copy_is_not_used(hub: LocalHub, tmp_path: Path, models: Path) -> None:
    it_dir = tmp_path / "it"
    (it_dir / NAME).parent.mkdir(parents=True)
    (it_dir / NAME).write_bytes(DATA[:-1] + b"\0")
    pinned = spec(sha256=SHA, size=SIZE)
    assert resolve_local(pinned, models_dir=models, readonly_dirs=[it_dir]) is None
    (path,) = pull([pinned], models_dir=models, readonly_dirs=[it_dir], endpoint=hub.url)
    assert path.parent.parent.parent.parent == models and path.read_bytes() == DATA


def test_sharded_quant_from_a_catalog_profile(hub: LocalHub, tmp_path: Path, models: Path) -> None:
    shards = [gguf_bytes(i, 200_000 + i) for i in (1, 2)]
    names = [f"big-q4_k_m-0000{i}-of-00002.gguf" for i in (1, 2)]
    for name, data in zip(names, shards, strict=True):
        hub.add_file("acme/Big-GGUF", name, data)
    profile = tmp_path / "profile"
    profile.mkdir()
    files = ", ".join(f'{{ filename = "{n}" }}' for n in names)
    (profile / "big.toml").write_text(
        textwrap.dedent(
            """
            [models.big]
            family = "qwen2.5-coder"
            role = "target"
            params_b = 99
            tokenizer = { family = "qwen2.5" }
            """
        )
        + tiny_arch("big", n_vocab=152064, tied=False)
        + f'[models.big.quants.Q4_K_M]\nrepo = "acme/Big-GGUF"\nfiles = [{files}]\n'
    )
    catalog = load_catalog([profile])
    quant = catalog.model("big").quants["Q4_K_M"]
    status = {(r.model_id, r.quant): r for r in model_status(catalog, models_dir=models)}
    assert not status["big", "Q4_K_M"].present
    paths = pull([quant], models_dir=models, endpoint=hub.url, progress=False)
    assert [p.read_bytes() for p in paths] == shards
    assert resolve_local(quant, models_dir=models) == paths[0]
    row = {(r.model_id, r.quant): r for r in model_status(catalog, models_dir=models)}
    assert row["big", "Q4_K_M"].present and row["big", "Q4_K_M"].verified
    assert row["big", "Q4_K_M"].path == paths[0]
    assert not row["qwen2.5-coder-7b", "Q8_0"].present
    assert row["qwen2.5-coder-7b", "Q8_0"].size_bytes == 8_098_525_600


def test_local_path_entries_bypass_the_hub(tmp_path: Path, models: Path) -> None:
    local = tmp_path / "mine.gguf"
    local.write_bytes(DATA)
    entry = FileSpec(filename="mine.gguf", path=str(local), sha256=SHA)
    assert pull([entry], models_dir=models, offline=True) == [local]
    bad = FileSpec(filename="mine.gguf", path=str(local), sha256="1" * 64)
    with pytest.raises(VerifyError, match="the catalog expects 1111"):
        pull([bad], models_dir=models)
    with pytest.raises(FetchError, match="does not exist"):
        pull([FileSpec(filename="x.gguf", path=str(tmp_path / "x.gguf"))], models_dir=models)


def test_hub_errors_say_what_is_wrong(hub: LocalHub, models: Path) -> None:
    with pytest.raises(FetchError, match=r"nope\.gguf not found in acme/Tiny-Coder-GGUF"):
        pull([FileSpec("nope.gguf", REPO)], models_dir=models, endpoint=hub.url)
    with pytest.raises(FetchError, match="repo acme/Missing not found"):
        pull([FileSpec(NAME, "acme/Missing")], models_dir=models, endpoint=hub.url)
    with pytest.raises(FetchError, match="revision deadbeef of acme"):
        pull([spec(revision="deadbeef")], models_dir=models, endpoint=hub.url)
    with pytest.raises(FetchError, match=r"cannot reach http://127\.0\.0\.1:9"):
        pull([spec()], models_dir=models, endpoint="http://127.0.0.1:9")


DISK_FULL = """
import resource, signal, sys
from pathlib import Path
from localspec.fetch import FetchError, FileSpec, pull
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    pull([FileSpec({name!r}, {repo!r})], models_dir=Path(sys.argv[1]), endpoint=sys.argv[2],
         force=True, progress=False)
except FetchError as exc:
    print(exc)
    sys.exit(3)
"""


def test_disk_full_discards_the_partial_and_keeps_the_good_file(
    hub: LocalHub, models: Path
) -> None:
    (good,) = pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    script = DISK_FULL.format(name=NAME, repo=REPO)
    result = subprocess.run(
        [sys.executable, "-c", script, str(models), hub.url, str(SIZE // 2)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3, result.stderr
    assert "disk full" in result.stdout and "partial file was removed" in result.stdout
    assert not good.with_name(NAME + ".partial").exists()
    assert good.read_bytes() == DATA
    assert resolve_local(spec(), models_dir=models) == good


def _profile_catalog(directory: Path, *quants: tuple[str, str, str]) -> Path:
    """A profile TOML: one model per (model id, repo, filename), each quant Q8_0."""
    directory.mkdir(parents=True, exist_ok=True)
    blocks = []
    for model_id, repo, filename in quants:
        blocks.append(
            textwrap.dedent(
                f"""
                [models.{model_id}]
                family = "qwen2.5-coder"
                role = "both"
                params_b = 0.1
                tokenizer = {{ family = "qwen2.5" }}
                """
            )
            + tiny_arch(model_id)
            + f'[models.{model_id}.quants.Q8_0]\nrepo = "{repo}"\n'
            + f'files = [{{ filename = "{filename}" }}]\n'
        )
    (directory / "profile.toml").write_text("\n".join(blocks))
    return directory


def test_up_with_files_present_makes_zero_requests(
    hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `up` runs (pull_plan with the user's Settings): first pull, then no network."""
    from types import SimpleNamespace

    draft_data = gguf_bytes(9, 100_000)
    hub.add_file("acme/Draft-GGUF", "draft.gguf", draft_data)
    catalog = load_catalog(
        [
            _profile_catalog(
                tmp_path / "profile",
                ("tiny", REPO, NAME),
                ("tinydraft", "acme/Draft-GGUF", "draft.gguf"),
            )
        ]
    )
    monkeypatch.setenv("LOCALSPEC_MODELS_DIR", str(tmp_path / "models"))
    token_file = tmp_path / "token"
    token_file.write_text("hf_fromfile\n")
    token_file.chmod(0o600)  # a secret file is refused when others can read it
    plan = SimpleNamespace(target=("tiny", "Q8_0"), draft=("tinydraft", "Q8_0"))
    settings = Settings(hub=HubSettings(endpoint=hub.url, token_file=token_file))
    target, draft = fetch.pull_plan(plan, settings=settings, catalog=catalog, progress=False)
    assert target.read_bytes() == DATA and draft is not None
    assert draft.read_bytes() == draft_data
    assert {r.authorization for r in hub.requests} == {"Bearer hf_fromfile"}
    hub.reset_counts()
    assert fetch.pull_plan(plan, settings=settings, catalog=catalog) == (target, draft)
    assert hub.requests == []
    offline = Settings(hub=HubSettings(offline=True))
    assert fetch.pull_plan(plan, settings=offline, catalog=catalog) == (target, draft)
    assert hub.requests == []


def test_pulls_a_real_gguf_that_gguf_can_read(smollm_q4: Path, tmp_path: Path) -> None:
    import gguf

    with LocalHub() as hub:
        hub.add_file("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", smollm_q4.name, smollm_q4)
        sha = hub.repos["HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"].files[smollm_q4.name].sha256
        pinned = FileSpec(
            smollm_q4.name,
            "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
            size=smollm_q4.stat().st_size,
            sha256=sha,
        )
        (path,) = pull([pinned], models_dir=tmp_path, endpoint=hub.url, progress=False)
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "llama"


def test_concurrent_pulls_of_one_file_download_it_once(hub: LocalHub, models: Path) -> None:
    import io
    import threading

    hub.paused = threading.Event()  # the first download stays under way until released
    outs = [io.StringIO(), io.StringIO()]
    results: list[object] = [None, None]

    def run(i: int) -> None:
        try:
            results[i] = pull([spec()], models_dir=models, endpoint=hub.url, out=outs[i])
        except Exception as exc:  # surfaced by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    threads[0].start()
    partial = models / "acme" / "Tiny-Coder-GGUF" / "main" / (NAME + ".partial")
    while not partial.exists() and threads[0].is_alive():  # the first is downloading
        threading.Event().wait(0.01)
    threads[1].start()
    deadline = time.monotonic() + 60
    while "waiting for another" not in outs[1].getvalue() and time.monotonic() < deadline:
        threading.Event().wait(0.01)  # the second pull found the first under way
    hub.paused.set()
    for t in threads:
        t.join(timeout=60)
    assert results[0] == results[1] and isinstance(results[0], list)
    assert results[0][0].read_bytes() == DATA
    # (the hub counts bytes before it sends them: both pulls are done, so is the count)
    assert hub.bytes_served(NAME) == SIZE  # one download, not two
    assert "waiting for another localspec download" in outs[1].getvalue()


def test_profile_proxy_routes_the_hub_traffic(
    hub: LocalHub, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import close_session

    for var in ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "no_proxy"):
        monkeypatch.setenv(var, "")  # restored after the test
    # the endpoint's host does not exist: only the proxy (our hub) can answer
    fetch.apply_network_settings(proxy=hub.url)
    try:
        (path,) = pull([spec()], models_dir=models, endpoint="http://hub.invalid", progress=False)
    finally:
        close_session()
    assert path.read_bytes() == DATA
    assert all(r.path.startswith("http://hub.invalid/") for r in hub.requests)


def test_ca_bundle_lets_a_private_tls_mirror_through(
    tmp_path: Path, models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import close_session

    cert, key = tmp_path / "mirror.pem", tmp_path / "mirror.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("SSL_CERT_FILE", "")  # restored after the test
    monkeypatch.delenv("SSL_CERT_FILE")  # the default trust store does not know our mirror
    with LocalHub(tls_cert=cert, tls_key=key) as mirror:
        mirror.add_file(REPO, NAME, DATA)
        close_session()
        with pytest.raises(FetchError, match=r"SSL_CERT_FILE or hub\.ca_bundle"):
            pull([spec()], models_dir=models, endpoint=mirror.url, progress=False)
        fetch.apply_network_settings(ca_bundle=cert)
        try:
            (path,) = pull([spec()], models_dir=models, endpoint=mirror.url, progress=False)
        finally:
            close_session()
    assert path.read_bytes() == DATA


def test_file_references_parse_for_the_cli() -> None:
    ref = FileSpec.parse("hf://acme/Tiny-GGUF@abc123/sub/tiny.gguf")
    assert (ref.repo, ref.revision, ref.filename) == ("acme/Tiny-GGUF", "abc123", "sub/tiny.gguf")
    assert FileSpec.parse("acme/Tiny-GGUF/tiny.gguf").revision is None
    for bad in ("tiny.gguf", "acme/tiny.gguf", "acme//x.gguf", "acme/Tiny-GGUF/readme.md"):
        with pytest.raises(ValueError, match="owner/repo"):
            FileSpec.parse(bad)


def test_a_changed_hub_never_costs_the_local_model(hub: LocalHub, models: Path) -> None:
    (path,) = pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    hub.add_file(REPO, NAME, b"new weights", commit="e" * 40)  # main moved, file replaced
    hub.reset_counts()
    assert pull([spec()], models_dir=models, endpoint=hub.url, progress=False) == [path]
    assert hub.requests == [] and path.read_bytes() == DATA
    # a catalog pinned to the old commit and sha256 still finds the copy pulled under main/
    old_commit = hashlib.sha1(REPO.encode()).hexdigest()
    record = path.with_name(NAME + ".verified.json").read_text()
    assert old_commit in record
    pinned = spec(revision=old_commit, sha256=SHA, size=SIZE)
    assert pull([pinned], models_dir=models, offline=True) == [path]
    assert resolve_local(spec(revision="e" * 40), models_dir=models) is None  # not proven


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_the_hub_token_file_is_read_under_the_secret_files_rule(tmp_path: Path) -> None:
    """The token file ``pull`` uses passes the same permission check as ``up``'s start-up
    rules (settings.read_secret_file): a file others can read is refused, not used."""
    token_file = tmp_path / "token"
    token_file.write_text("hf_secret\n")
    token_file.chmod(0o644)
    settings = Settings(hub=HubSettings(token_file=token_file, offline=True))
    with pytest.raises(SettingsError, match="readable by group or others"):
        fetch.hub_options(settings)
    with pytest.raises(SettingsError, match="readable by group or others"):
        check_security(settings)
    token_file.chmod(0o600)
    assert fetch.hub_options(settings)["token"] == "hf_secret"


def test_a_mirror_that_answers_5xx_for_a_moment_is_tried_again(
    hub: LocalHub, models: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A proxy's 502 on the metadata, then a 503 on the download itself: the file comes, and
    the user is told why it waits."""
    hub.blips = [(502, None, "HEAD"), (503, None, "GET")]
    (path,) = pull([spec()], models_dir=models, endpoint=hub.url)
    assert path.read_bytes() == DATA
    err = capfd.readouterr().err
    assert "answered HTTP 502" in err and "answered HTTP 503" in err
    assert "trying again in 0 s (1 of 3)" in err
    assert [r.status for r in hub.requests if r.method == "GET"] == [503, 200]


def test_a_rate_limit_is_waited_out_only_when_it_is_short(hub: LocalHub, models: Path) -> None:
    hub.blips = [(429, "1", "HEAD")]
    t0 = time.monotonic()
    (path,) = pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    assert path.read_bytes() == DATA and time.monotonic() - t0 >= 1.0  # its Retry-After
    path.unlink()
    hub.blips = [(429, "3600", "HEAD")]
    hub.reset_counts()
    t0 = time.monotonic()
    with pytest.raises(FetchError, match=r"rate-limiting .*wait 3600 s.*HF_TOKEN"):
        pull([spec()], models_dir=models, endpoint=hub.url, progress=False, force=True)
    assert time.monotonic() - t0 < 30 and len(hub.requests) == 1  # reported, not slept through


def test_a_hub_that_stays_down_is_reported_after_three_more_tries(
    hub: LocalHub, models: Path
) -> None:
    hub.failing.add(NAME)
    with pytest.raises(FetchError, match="503"):
        pull([spec()], models_dir=models, endpoint=hub.url, progress=False)
    assert [r.method for r in hub.requests] == ["HEAD"] * 4
