"""Control-plane authentication: secrets, the job namespace, sealed messages, a store bound to one
address (deadpool/store/auth.py). Fast: real TCPStores on port 0, no training processes."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from deadpool.store import auth

SECRET = "a" * 64
OTHER = "b" * 64


def listening(port: int) -> list[tuple[str, str]]:
    """(table, hex local address) of every socket in LISTEN state on ``port``, from /proc/net."""
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A = TCP_LISTEN
                found.append((table, addr))
    return found


def non_loopback_ipv4() -> str | None:
    """An address of this machine that is not loopback, if any (a UDP connect sends nothing)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.254", 9))
        addr = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


# -- seals -----------------------------------------------------------------------------------------

def test_seal_round_trip():
    text = '{"generation": 3, "action": "train", "note": "a:b:c \u00e9"}'
    sealed = auth.seal(SECRET, text)
    assert sealed != text and sealed.endswith(text)
    assert auth.unseal(SECRET, sealed) == text
    assert auth.unseal(SECRET, sealed.encode()) == text  # what store.get returns
    assert auth.unseal(SECRET, auth.seal(SECRET, "")) == ""
    key = "fence/3"
    assert auth.unseal(SECRET, auth.seal(SECRET, "1", context=key), context=key) == "1"


def test_forged_or_altered_messages_are_refused():
    sealed = auth.seal(SECRET, "abort gen 2", context="g2/abort")
    version, tag, text = sealed.split(":", 2)
    flipped = tag[:-1] + ("0" if tag[-1] != "0" else "1")
    forgeries = {
        "unsealed": "abort gen 2",
        "altered text": f"{version}:{tag}:abort gen 3",
        "altered tag": f"{version}:{flipped}:{text}",
        "truncated tag": f"{version}:{tag[:32]}:{text}",
        "empty tag": f"{version}::{text}",
        "another secret": auth.seal(OTHER, "abort gen 2", context="g2/abort"),
        "not utf-8": b"\xff\xfe" + sealed.encode(),
        "non-ascii tag": f"{version}:{chr(0xe9) * 64}:{text}",
    }
    for what, msg in forgeries.items():
        with pytest.raises(auth.AuthError):
            auth.unseal(SECRET, msg, context="g2/abort")
            pytest.fail(f"{what} accepted")
    with pytest.raises(auth.AuthError):  # replayed under another key: a fence moved to slot 5
        auth.unseal(SECRET, auth.seal(SECRET, "1", context="fence/3"), context="fence/5")


# -- namespace -------------------------------------------------------------------------------------

def test_namespace_is_derived_from_the_secret():
    ns = auth.namespace(SECRET)
    assert ns == auth.namespace(SECRET) and ns != auth.namespace(OTHER)
    assert ns.startswith("job-") and len(ns) == len("job-") + 16
    assert SECRET not in ns and SECRET[:16] not in ns


def test_wrong_secret_cannot_read_the_jobs_keys():
    master = auth.serve_store("127.0.0.1", 0, timeout_s=10)
    job = auth.namespaced(master, SECRET)
    plan = auth.seal(SECRET, '{"generation": 0}', context="plan/0")
    job.set("plan/0", plan)

    right = auth.open_store("127.0.0.1", master.port, SECRET, timeout_s=10)
    assert auth.unseal(SECRET, right.get("plan/0"), context="plan/0") == '{"generation": 0}'

    wrong = auth.open_store("127.0.0.1", master.port, OTHER, timeout_s=0.5)
    assert not wrong.check(["plan/0"])
    with pytest.raises(dist.DistStoreError):  # waits for a key that, for it, does not exist
        wrong.get("plan/0")
    wrong.set("plan/1", "forged")  # lands in another namespace: the job never sees it
    assert not job.check(["plan/1"])

    raw = dist.TCPStore("127.0.0.1", master.port, is_master=False,
                        timeout=timedelta(seconds=10), use_libuv=True)
    assert not raw.check(["plan/0"])  # no namespace: nothing there
    assert raw.check([auth.namespace(SECRET) + "/plan/0"])  # where PrefixStore put it


def test_a_client_that_finds_the_namespace_still_cannot_forge():
    """torch 2.13's ``list_keys`` shows any connected client the namespace: seals must hold."""
    master = auth.serve_store("127.0.0.1", 0, timeout_s=10)
    job = auth.namespaced(master, SECRET)
    job.set("plan/0", auth.seal(SECRET, '{"action": "train"}', context="plan/0"))
    intruder = dist.TCPStore("127.0.0.1", master.port, is_master=False,
                             timeout=timedelta(seconds=10), use_libuv=True)
    if hasattr(intruder, "list_keys"):
        assert intruder.list_keys() == [auth.namespace(SECRET) + "/plan/0"]
    key = auth.namespace(SECRET) + "/plan/0"
    _, tag, _ = intruder.get(key).decode().split(":", 2)
    intruder.set(key, f"s1:{tag}:" + '{"action": "stop"}')  # old tag, new text
    with pytest.raises(auth.AuthError):
        auth.unseal(SECRET, job.get("plan/0"), context="plan/0")
    intruder.set(key, auth.seal(OTHER, '{"action": "stop"}', context="plan/0"))  # own key
    with pytest.raises(auth.AuthError):
        auth.unseal(SECRET, job.get("plan/0"), context="plan/0")


def test_open_store_as_master_serves_the_namespace():
    job = auth.open_store("127.0.0.1", 0, SECRET, timeout_s=10, is_master=True)
    port = job.underlying_store.port
    job.set("hb/0", "1")
    assert auth.open_store("127.0.0.1", port, SECRET, timeout_s=10).get("hb/0") == b"1"
    assert listening(port) == [("tcp", "0100007F")]


# -- secrets ---------------------------------------------------------------------------------------

def test_new_secret_is_fresh_and_long():
    a, b = auth.new_secret(), auth.new_secret()
    assert a != b and len(a) == 64 and int(a, 16) >= 0


def test_load_secret_from_env():
    assert auth.load_secret({auth.SECRET_ENV: SECRET + "\n"}) == SECRET
    # the variable wins over a file
    assert auth.load_secret({auth.SECRET_ENV: SECRET, auth.SECRET_FILE_ENV: "/nonexistent"}) == SECRET


def _secret_file(tmp_path, mode: int, content: str = SECRET + "\n"):
    path = tmp_path / "job.secret"
    path.write_text(content)
    os.chmod(path, mode)
    return path


def test_load_secret_from_a_private_file(tmp_path):
    path = _secret_file(tmp_path, 0o600)
    assert auth.load_secret({auth.SECRET_FILE_ENV: str(path)}) == SECRET
    os.chmod(path, 0o400)
    assert auth.load_secret({auth.SECRET_FILE_ENV: str(path)}) == SECRET


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_load_secret_refuses_a_file_others_can_read(tmp_path, mode):
    path = _secret_file(tmp_path, mode)
    with pytest.raises(auth.AuthError) as e:
        auth.load_secret({auth.SECRET_FILE_ENV: str(path)})
    msg = str(e.value)
    assert f"{mode:04o}" in msg and "too open" in msg and "chmod 600" in msg
    assert SECRET not in msg


def test_load_secret_says_how_to_provide_it(tmp_path):
    with pytest.raises(auth.AuthError) as e:
        auth.load_secret({})
    assert auth.SECRET_ENV in str(e.value) and auth.SECRET_FILE_ENV in str(e.value)
    with pytest.raises(auth.AuthError, match="cannot open"):
        auth.load_secret({auth.SECRET_FILE_ENV: str(tmp_path / "missing")})
    with pytest.raises(auth.AuthError, match="shorter"):
        auth.load_secret({auth.SECRET_FILE_ENV: str(_secret_file(tmp_path, 0o600, "short\n"))})
    with pytest.raises(auth.AuthError, match="shorter"):
        auth.load_secret({auth.SECRET_ENV: "0123456789"})
    with pytest.raises(auth.AuthError, match="no job secret"):  # blank counts as unset
        auth.load_secret({auth.SECRET_ENV: "   "})


# -- binding ---------------------------------------------------------------------------------------

def test_serve_store_listens_on_loopback_only():
    store = auth.serve_store("127.0.0.1", 0, timeout_s=10)
    # the kernel's own record: one listener, IPv4 127.0.0.1 (not 0.0.0.0, not [::])
    assert listening(store.port) == [("tcp", "0100007F")]
    socket.create_connection(("127.0.0.1", store.port), timeout=2).close()
    other = non_loopback_ipv4()
    if other is not None:  # this machine has another interface: the store must not answer there
        with pytest.raises(OSError):
            socket.create_connection((other, store.port), timeout=2).close()


def test_serve_store_port_zero_picks_a_free_port():
    a = auth.serve_store("127.0.0.1", 0, timeout_s=10)
    b = auth.serve_store("127.0.0.1", 0, timeout_s=10)
    assert a.port > 0 and b.port > 0 and a.port != b.port
    assert listening(a.port) and listening(b.port)
    a.set("k", "v")
    client = dist.TCPStore("127.0.0.1", a.port, is_master=False, timeout=timedelta(seconds=10),
                           use_libuv=True)
    assert client.get("k") == b"v"
    with pytest.raises(OSError):  # a taken port is an error, not a silent second server
        auth.serve_store("127.0.0.1", a.port, timeout_s=10)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_serve_store_refuses_a_wildcard_host(host):
    with pytest.raises(ValueError, match="wildcard"):
        auth.serve_store(host, 0, timeout_s=10)


# -- launchers -------------------------------------------------------------------------------------

def test_local_launcher_gives_the_secret_to_children_only_by_env(tmp_path, monkeypatch):
    from deadpool.launch import launcher

    seen = []

    class FakePopen:
        def __init__(self, argv, env, **kw):
            seen.append((argv, env))

    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    monkeypatch.setenv(auth.SECRET_FILE_ENV, "/stale/file")
    la = launcher.LocalLauncher(tmp_path, tmp_path / "job.json", SECRET)
    la.start([0, 1])
    assert len(seen) == 2
    for argv, env in seen:
        assert env[auth.SECRET_ENV] == SECRET and auth.SECRET_FILE_ENV not in env
        assert not any(SECRET in a for a in argv)


def test_external_launcher_seals_fences():
    from deadpool.launch.launcher import ExternalLauncher
    from deadpool.store.protocol import Keys

    master = auth.serve_store("127.0.0.1", 0, timeout_s=10)
    job = auth.namespaced(master, SECRET)
    ExternalLauncher(job, SECRET).kill(3)
    assert auth.unseal(SECRET, job.get(Keys.fence(3)), context=Keys.fence(3)) == "1"
    with pytest.raises(auth.AuthError):
        auth.unseal(SECRET, job.get(Keys.fence(3)), context=Keys.fence(5))
