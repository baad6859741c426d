"""Prompts of the four acceptance workloads, written for this tool in the style of the small trained
model's training text (Python documentation and fortunes, standard-library code, JSON records,
enumerations). Acceptance is a property of the workload: a decode figure needs its workload."""

from __future__ import annotations

WORKLOADS: dict[str, list[str]] = {
    "prose": [
        "The interpreter reads a file one statement at a time. When an exception is raised and nothing\n"
        "handles it, the program stops and a traceback is printed. This section describes how",
        "A module is a file containing definitions and statements. Within a module, the module's name\n"
        "is available as the value of the global variable. When you run a module as a script,",
        "You will meet a stranger who knows the way. Patience is the companion of wisdom, and a\n"
        "quiet mind is the beginning of",
        "The garbage collector frees objects that are no longer reachable. Most programs never need to\n"
        "call it directly, but long running servers",
    ],
    "code": [
        "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description=\"Process some files.\")\n"
        "    parser.add_argument(\"paths\", nargs=\"*\", help=\"files to read\")\n    parser.add_argument(",
        "class Queue:\n    \"\"\"A simple first-in, first-out queue.\"\"\"\n\n    def __init__(self, maxsize=0):\n"
        "        self.maxsize = maxsize\n        self._items = []\n\n    def put(self, item):\n",
        "import os\nimport sys\n\n\ndef walk(top, topdown=True):\n    \"\"\"Yield (dirpath, dirnames, filenames).\"\"\"\n"
        "    names = os.listdir(top)\n    dirs, files = [], []\n    for name in names:\n",
        "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, self.data)\n\n"
        "    def __len__(self):\n        return len(self.data)\n\n    def __getitem__(self, key):\n",
    ],
    "json": [
        "[{\"order_id\": \"ORD-120301\", \"item\": \"keyboard\", \"quantity\": 2, \"unit_price\": 49.99, "
        "\"currency\": \"USD\", \"status\": \"shipped\", \"shipping\": {\"city\": \"Boston\", \"express\": true}}, "
        "{\"order_id\": \"ORD-120302\", \"item\": ",
        "[{\"order_id\": \"ORD-554410\", \"item\": \"monitor\", \"quantity\": 1, \"unit_price\": 219.5, "
        "\"currency\": \"EUR\", \"status\": \"pending\", \"shipping\": {\"city\": \"Lyon\", \"express\": false}}, "
        "{\"order_id\": \"ORD-554411\", \"item\": \"monitor\", ",
        "[{\"order_id\": \"ORD-907770\", \"item\": \"printer\", \"quantity\": 5, \"unit_price\": 1299.0, "
        "\"currency\": \"GBP\", \"status\": \"delivered\", \"shipping\": {\"city\": \"Leeds\", \"express\": true}}, "
        "{\"order_id\": ",
        "[{\"order_id\": \"ORD-310005\", \"item\": \"cable\", \"quantity\": 12, \"unit_price\": 3.75, "
        "\"currency\": \"USD\", \"status\": \"cancelled\", \"shipping\": {\"city\": \"Austin\", \"express\": false}}, ",
    ],
    "enumeration": [
        "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2: the quick brown fox jumps over the lazy dog.\n"
        "Line 3: the quick brown fox jumps over the lazy dog.\nLine 4:",
        "Line 17: the quick brown fox jumps over the lazy dog.\nLine 18: the quick brown fox jumps over the lazy dog.\n"
        "Line 19:",
        "Line 40: the quick brown fox jumps over the lazy dog.\nLine 41: the quick brown fox jumps over the lazy dog.\n"
        "Line 42: the quick brown fox jumps over the lazy dog.\nLine 43: the quick",
        "Line 5: the quick brown fox jumps over the lazy dog.\nLine 6:",
    ],
}
