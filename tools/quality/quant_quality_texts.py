"""Held-out texts for `tools/quality/quant_quality.py`, written for it (not taken from the model's training
data): four kinds the shared tiny model was trained on -- prose in the style of Python documentation
and fortunes, Python code, JSON records, enumerations -- each with texts for teacher forcing and
four prompts for greedy decoding."""

from __future__ import annotations

TEXTS: dict[str, list[str]] = {
    "prose": [
        "The :mod:`shelve` module keeps a persistent dictionary on disk. Keys are ordinary strings, and the "
        "values may be any object that the pickle module can handle. Opening a shelf returns an object that "
        "behaves like a dictionary, except that changes are written back only when the shelf is synchronized "
        "or closed. If you need to share a shelf between processes, you must arrange the locking yourself; "
        "the module does not do it for you. See the documentation of :func:`open` for the meaning of the flag "
        "argument and the protocol version used for new entries.",
        "A friend who asks nothing of you is rarer than a river that runs uphill. You will find an old letter "
        "this week, and it will remind you of a promise you meant to keep. Patience is the art of hoping while "
        "doing something else. Tomorrow brings a small surprise; greet it kindly and it will stay for dinner. "
        "The best time to plant a tree was long ago; the second best time is after lunch.",
        "This section describes how the interpreter finds a module when it is imported. The search starts with "
        "the modules that are already loaded, then consults each finder on the meta path in turn. A finder "
        "that recognizes the name returns a specification describing how to load the module, and the loader "
        "named in that specification executes the module's code in a fresh namespace. If no finder succeeds, "
        "the import raises :exc:`ModuleNotFoundError`, which is a subclass of :exc:`ImportError`.",
    ],
    "code": [
        "import os\nimport sys\n\n\ndef walk_sizes(root):\n    \"\"\"Return a dict mapping each file under root to its size.\"\"\"\n"
        "    sizes = {}\n    for dirpath, dirnames, filenames in os.walk(root):\n        for name in filenames:\n"
        "            path = os.path.join(dirpath, name)\n            try:\n                sizes[path] = os.path.getsize(path)\n"
        "            except OSError:\n                continue\n    return sizes\n\n\nif __name__ == \"__main__\":\n"
        "    for path, size in sorted(walk_sizes(sys.argv[1]).items()):\n        print(size, path)\n",
        "class Counter:\n    \"\"\"Count how often each item was seen.\"\"\"\n\n    def __init__(self):\n        self._counts = {}\n\n"
        "    def add(self, item):\n        self._counts[item] = self._counts.get(item, 0) + 1\n\n    def most_common(self, n=None):\n"
        "        items = sorted(self._counts.items(), key=lambda kv: kv[1], reverse=True)\n        if n is None:\n"
        "            return items\n        return items[:n]\n\n    def __len__(self):\n        return len(self._counts)\n\n"
        "    def __repr__(self):\n        return \"%s(%r)\" % (self.__class__.__name__, self._counts)\n",
        "def _check_arg(name, value, allowed):\n    if value not in allowed:\n        raise ValueError(\"%s must be one of %r, not %r\" "
        "% (name, allowed, value))\n    return value\n\n\ndef merge(left, right):\n    result = []\n    i = j = 0\n"
        "    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n            result.append(left[i])\n"
        "            i += 1\n        else:\n            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n"
        "    result.extend(right[j:])\n    return result\n",
    ],
    "json": [
        '[{"id": 204117, "name": "Lena Okafor", "age": 41, "city": "Lisbon", "email": "user204117@example.com", '
        '"active": false, "tags": ["admin"]}, {"id": 204118, "name": "Kenji Ruiz", "age": 23, "city": "Osaka", '
        '"email": "user204118@example.com", "active": true, "tags": ["beta", "staff"]}, {"id": 204119, "name": '
        '"Ana Novak", "age": 35, "city": "Toronto", "email": "user204119@example.com", "active": true, "tags": []}]',
        '[{"order_id": "ORD-552310", "item": "monitor", "quantity": 2, "unit_price": 219.5, "currency": "USD", '
        '"status": "shipped", "shipping": {"city": "Austin", "express": true}}, {"order_id": "ORD-552311", "item": '
        '"keyboard", "quantity": 5, "unit_price": 49.99, "currency": "USD", "status": "pending", "shipping": '
        '{"city": "Boston", "express": false}}]',
        '[{"event": "logout", "ts": 1712003311, "user_id": 90412, "latency_ms": 41, "ok": true, "path": '
        '"/api/v1/session"}, {"event": "search", "ts": 1712003318, "user_id": 90412, "latency_ms": 230, "ok": true, '
        '"path": "/api/v1/items?q=lamp"}, {"event": "purchase", "ts": 1712003402, "user_id": 90412, "latency_ms": '
        '512, "ok": false, "path": "/api/v1/orders"}]',
    ],
    "enumeration": [
        "".join(f"Line {i}: a stitch in time saves nine.\n" for i in range(40, 52)),
        "".join(f"- lantern {i}\n" for i in range(3, 20)),
        "".join(f"{i}. step {i}\n" for i in range(1, 22)),
    ],
}

PROMPTS: dict[str, list[str]] = {
    "prose": [
        "The :mod:`array` module defines an object type which can compactly represent",
        "A wise traveller carries",
        "This chapter explains how exceptions are raised and handled. When an error occurs,",
        "Every morning brings",
    ],
    "code": [
        "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n    with open(path) as f:\n",
        "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
        "def is_prime(n):\n    if n < 2:\n        return False\n",
        "    def __eq__(self, other):\n        if not isinstance(other, self.__class__):\n",
    ],
    "json": [
        '[{"id": 771002, "name": "Priya Haddad", "age": 52, "city": "Madrid", "email": "',
        '[{"order_id": "ORD-100871", "item": "desk", "quantity": 1, "unit_price": ',
        '[{"event": "click", "ts": 1713000000, "user_id": 5521, "latency_ms": 77, "ok": true, "path": "',
        '[\n  {\n    "id": 12001,\n    "name": "Tom Berg",\n    "age": 19,\n',
    ],
    "enumeration": [
        "Line 7: the early bird catches the worm.\nLine 8: the early bird catches the worm.\nLine 9:",
        "- river 1\n- river 2\n- river 3\n",
        "1. chapter 1\n2. chapter 2\n3.",
        "Item 30: blue\nItem 31: blue\nItem 32:",
    ],
}
