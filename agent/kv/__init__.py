"""KV storage below the bound tier: snapshots, the host LRU, the prefix cache and the disk tier.

Pure Python and numpy; nothing here imports LiteRT. The runtime turns bound KV buffers into
`agent.kv.snapshot.KVSnapshot` values and back; these modules only hold, bound and persist them.
"""
