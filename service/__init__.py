"""HTTP inference service for latentlm models: FastAPI app, dynamic batcher, Redis cache and batch jobs."""
