"""No secret of a column leaves the process (issue 41): a password in a URL's userinfo
(with ``@`` in it), a presigned signature, a token in a query or fragment, and raw terminal
escapes in a file name, searched for in everything a user or a group member sees: the
exception, the warnings, stderr, every file under the shared root and in the bucket, and
the command line's ``ls --json``, ``info`` and ``verify``."""

from __future__ import annotations

import json
import os
import re
import textwrap

from hypothesis import given, settings, strategies as st

from cachekit import redaction
from hosts import finish

SECRETS = ("PWSECRET", "SIGSECRET", "TOKSECRET", "FRAGSECRET", "CREDSECRET")
RAW_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
"""A raw control character (newline aside): what a terminal would interpret."""

VICTIM = textwrap.dedent('''
    import json, os, sys, time, warnings
    import numpy as np
    from PIL import Image
    import cachekit
    from cachekit.obtain import background, staleness

    root, server, folder = sys.argv[1], sys.argv[2], sys.argv[3]
    local = os.path.join(folder, "esc\\x1b[31mred.png")
    Image.fromarray(np.zeros((9, 9, 3), np.uint8)).save(local, format="PNG")
    host = server.split("://", 1)[1]
    column = [f"{server}/d/ok-1.png?X-Amz-Signature=SIGSECRET&X-Amz-Credential=CREDSECRET",
              f"http://user:pa@ss:PWSECRET@{host}/d/missing.png?token=TOKSECRET#FRAGSECRET",
              f"http://user:PWSECRET@{host}/d/gzip.png#FRAGSECRET",
              local]
    texts = []
    cache = cachekit.Cache(root, workers=1)
    try:
        cache.images(column, 8, backend="pil")
    except cachekit.ImageDecodeError as e:
        texts += [str(e), repr(e.failures)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry = cache.images(column, 8, backend="pil", on_error="zero")
        os.utime(local, ns=(1, 1))  # changed since the build: the hit's check says so
        hit = cachekit.Cache(root, workers=1).images(column, 8, backend="pil",
                                                      on_error="zero")
        staleness.wait_for_checks(30)
        background.wait_all()
    texts += [str(w.message) for w in caught]
    print(json.dumps({"texts": texts, "key": entry.key, "stale": len(caught)}))
''')

READER = textwrap.dedent('''
    import json, os, sys
    found, unreadable = {}, 0
    for folder, _, names in os.walk(sys.argv[1]):
        for name in names:
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    found[path] = f.read(64 << 20).decode("latin-1")
            except OSError:
                unreadable += 1
    print(json.dumps({"files": found, "unreadable": unreadable}))
''')


def _leaks(where: str, text: str) -> list[str]:
    """The secrets in ``text``, and for text (not a data file) a raw control character."""
    binary = where.endswith((".npy", ".lock")) or "/parts/" in where  # pool: .npy bytes
    return [s for s in SECRETS if s in text] + (
        ["a raw control character"] if not binary and RAW_CONTROL.search(text) else [])


def test_no_secret_of_a_column_reaches_anything_a_user_or_group_member_reads(
        shared_root, hostile, s3_env):
    folder = shared_root.base / "images"
    folder.mkdir()
    os.chown(folder, shared_root.victim.uid, -1)
    env = {**s3_env, "CACHEKIT_SOURCE_TIMEOUT": "5"}
    victim = finish(shared_root.victim.python(shared_root.script(VICTIM), shared_root.root,
                                              hostile.url, folder, env=env))
    got = victim.report()
    assert got["stale"] >= 1 and len(got["texts"]) >= 3  # the error, its rows, the warning
    seen = {"victim's exception and warnings": "\n".join(got["texts"]),
            "victim's stderr": victim.stderr}
    for args in (["ls", "--json"], ["info", got["key"]], ["verify"]):
        done = finish(shared_root.victim.cli(shared_root.root, *args, env=env))
        assert done.returncode == 0, done.stderr
        seen[f"cachekit {' '.join(args)}"] = done.stdout + done.stderr
    member = finish(shared_root.attacker.python(shared_root.script(READER), shared_root.root))
    files = member.report()["files"]
    assert any(name.endswith("manifest.json") for name in files)
    assert any(name.endswith(".failed.json") for name in files)  # the failure record
    seen.update({f"group member reads {name}": text for name, text in files.items()})
    for path in shared_root.root.rglob("*"):  # and what the group cannot read, as root
        if path.is_file():
            seen[f"file {path}"] = path.read_bytes().decode("latin-1")
    import fsspec

    bucket = s3_env["CACHEKIT_REMOTE"]
    fs, prefix = fsspec.core.url_to_fs(bucket)
    objects = fs.find(prefix)
    assert any(name.endswith("manifest.json") for name in objects)
    seen.update({f"object {name}": fs.cat_file(name).decode("latin-1") for name in objects})
    leaks = {where: found for where, text in seen.items() if (found := _leaks(where, text))}
    assert leaks == {}


SAFE = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)


@settings(max_examples=500)
@given(user=SAFE, password=SAFE, signature=SAFE, path=SAFE)
def test_no_password_or_query_survives_the_rule(user, password, signature, path):
    secret = "Z9" + password  # a password that cannot stand for a scheme, host or path
    url = f"https://{user}:{secret}@images.example:8443/{path}/a.jpg?X-Amz-Signature={signature}#t"
    shown = redaction.value(url)
    assert secret not in shown
    assert "X-Amz-Signature" not in shown and not shown.endswith("#t")
    assert shown.startswith("https://")
    assert secret not in redaction.text(f"GET '{url}' failed: 404")
