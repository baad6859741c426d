"""Structured output: JSON schema, JSON object, regex, EBNF grammar, choice and structural tags,
through xgrammar (docs/structured-output.md). `spec` and `grammars` import neither torch nor
xgrammar; the rest does."""
