"""The service's routers, one module per concern: `health` (/health, /ready, /metrics), `models`
(/v1/models...), `operations` (/v1/score, posterior, decode, embed, sample) and `batches` (/v1/files,
/v1/batches)."""
