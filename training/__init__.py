"""Training pipelines: data, Brown clustering, Baum-Welch and neural HMM families, export to the store."""
