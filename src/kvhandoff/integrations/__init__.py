"""Engine integrations: kvhandoff behind an engine's own connector API (C-05).

Each subpackage imports its engine lazily, so `kvhandoff` stays importable without it."""
