"""Model families and their exact inference, shared by training and the service.

Every family lives in one module (its parameters, its artifact schema and its operations); the chain
engine (`models.chain`) holds the forward/backward/max-product/sampling recursions written once.
"""
