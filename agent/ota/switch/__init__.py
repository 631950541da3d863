"""When a committed download may switch (idle, a maintenance window) and how a download uses
the link (a bandwidth cap, a metered link): docs/UPDATES.md, "When to switch"."""
