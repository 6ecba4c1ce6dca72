"""HTTP plumbing shared by every API: request context, error bodies and SSE, metrics, the OpenAPI
document and the shared wire types."""
