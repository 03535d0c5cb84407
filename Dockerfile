# The fleetscope image: every CLI command (init, worker, sink, alerts, simulate, report, agent, ...).
# Built by docker-compose.yml; configuration comes from FLEETSCOPE__SECTION__KEY variables.
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fleetscope ./fleetscope
COPY producers ./producers
COPY schemas ./schemas
COPY streams ./streams
COPY sinks ./sinks
# Wheels for fleetscope and every dependency, so the runtime stage installs offline and stays small.
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[registry]"

FROM python:3.11.11-slim-bookworm
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/fleetscope fleetscope
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels "fleetscope[registry]" && rm -rf /wheels
USER fleetscope
WORKDIR /var/lib/fleetscope
ENV PYTHONUNBUFFERED=1 \
    FLEETSCOPE__DATA_DIR=/var/lib/fleetscope
# Prometheus /metrics of worker, sink and agent when FLEETSCOPE__METRICS_PORT=9100
EXPOSE 9100
ENTRYPOINT ["fleetscope"]
CMD ["--help"]
