defmodule EMLXAxon.Scheduler.Server do
  @moduledoc false
  # The process behind EMLXAxon.Scheduler (see there): it owns the native
  # scheduler, whose own thread steps the batch and sends this process each
  # step's tokens; it admits requests and passes the tokens to their callers.

  use GenServer

  alias EMLXAxon.{Error, Native, Result, Telemetry, Tokenizer}

  # Messages to callers are tagged with the public module.
  @tag EMLXAxon.Scheduler

  @doc false
  def start_link(opts, gen_opts), do: GenServer.start_link(__MODULE__, opts, gen_opts)

  @impl true
  def init(opts) do
    tokenizer_ref = if opts.tokenizer, do: opts.tokenizer.ref

    native_opts = %{
      slots: opts.slots,
      capacity: opts.capacity,
      prefill_chunk: prefill_chunk(opts.prefill_chunk),
      prefix_cache_bytes: opts.prefix_cache_bytes,
      prefix_min_tokens: opts.prefix_min_tokens,
      kv_dtype: EMLXAxon.Options.native_kv_dtype(opts.kv_dtype),
      steps_per_call: opts.steps_per_call,
      step_budget_us: opts.step_budget_ms * 1000
    }

    case Error.wrap(Native.scheduler_new(opts.model.ref, tokenizer_ref, native_opts)) do
      {:ok, resource} ->
        Process.flag(:trap_exit, true)

        {:ok,
         %{
           resource: resource,
           model: opts.model,
           tokenizer: opts.tokenizer,
           slots: opts.slots,
           max_queue: opts.max_queue,
           # native id -> request; ref -> native id
           requests: %{},
           ids: %{}
         }}

      {:error, error} ->
        {:stop, error}
    end
  end

  @impl true
  def handle_call({:submit, pid, prompt, native_opts, timeout}, _from, state) do
    with :ok <- check_load(state),
         :ok <- check_constraint(native_opts, state.tokenizer),
         {:ok, ids} <- prompt_ids(prompt, state.tokenizer),
         {:ok, id} <- admit(state.resource, ids, native_opts) do
      ref = make_ref()
      if timeout != :infinity, do: Process.send_after(self(), {:expire, ref}, timeout)

      request = %{
        ref: ref,
        pid: pid,
        monitor: Process.monitor(pid),
        prompt_tokens: length(ids)
      }

      state = %{
        state
        | requests: Map.put(state.requests, id, request),
          ids: Map.put(state.ids, ref, id)
      }

      {:reply, {:ok, ref}, state}
    else
      {:error, _} = error -> {:reply, error, state}
      {:raise, _} = raise -> {:reply, raise, state}
    end
  end

  def handle_call({:cancel, ref}, _from, state) do
    {:reply, :ok, drop(state, Map.get(state.ids, ref))}
  end

  def handle_call(:occupancy, _from, state) do
    reply =
      case Error.wrap(Native.scheduler_occupancy(state.resource)) do
        {:ok, occupancy} -> occupancy
        {:error, error} -> raise error
      end

    {:reply, reply, state}
  end

  def handle_call(:model, _from, state) do
    {:reply, %{model: state.model, tokenizer: state.tokenizer}, state}
  end

  def handle_call(:clear_prefix_cache, _from, state) do
    {:ok, :ok} = Error.wrap(Native.scheduler_clear_prefix_cache(state.resource))
    {:reply, :ok, state}
  end

  @impl true
  def handle_info({:emlx_axon_scheduler, output}, state) do
    case Error.wrap(output) do
      {:ok, {events, occupancy, elapsed_us}} ->
        state = Enum.reduce(events, state, &deliver/2)
        emit_step(elapsed_us, events, occupancy)
        {:noreply, state}

      {:error, error} ->
        # The engine dropped every request it held; those admitted since
        # are cancelled, so every caller gets the error.
        for {_id, request} <- state.requests do
          send(request.pid, {@tag, request.ref, {:error, error}})
          Process.demonitor(request.monitor, [:flush])
        end

        Native.scheduler_cancel(state.resource, Map.keys(state.requests))

        {:noreply, %{state | requests: %{}, ids: %{}}}
    end
  end

  def handle_info({:expire, ref}, state) do
    case Map.fetch(state.ids, ref) do
      {:ok, id} ->
        request = state.requests[id]

        send(
          request.pid,
          {@tag, request.ref, {:done, :timeout, %{prompt_tokens: request.prompt_tokens}}}
        )

        {:noreply, drop(state, id)}

      :error ->
        {:noreply, state}
    end
  end

  def handle_info({:DOWN, monitor, :process, _pid, _reason}, state) do
    case Enum.find(state.requests, fn {_id, r} -> r.monitor == monitor end) do
      {id, _request} -> {:noreply, drop(state, id)}
      nil -> {:noreply, state}
    end
  end

  def handle_info({:EXIT, _pid, reason}, state), do: {:stop, reason, state}
  def handle_info(_other, state), do: {:noreply, state}

  @impl true
  def terminate(_reason, state) do
    error = Error.exception(kind: :released, message: "the scheduler stopped")

    for {_id, request} <- state.requests do
      send(request.pid, {@tag, request.ref, {:error, error}})
    end

    Native.scheduler_free(state.resource)
    :ok
  end

  # Up to `slots` requests run and `max_queue` more wait.
  defp check_load(state) do
    if map_size(state.requests) >= state.slots + state.max_queue,
      do: {:error, :overloaded},
      else: :ok
  end

  defp check_constraint(%{constraint: {kind, _text}}, nil),
    do: {:raise, "#{inspect(kind)} needs a scheduler started with a :tokenizer"}

  defp check_constraint(_native_opts, _tokenizer), do: :ok

  # A schema, regex or grammar the engine refuses is the caller's argument
  # error; the engine compiles it before queueing anything.
  defp admit(resource, ids, native_opts) do
    case Error.wrap(Native.scheduler_admit(resource, ids, native_opts)) do
      {:error, %Error{kind: :invalid_constraint, message: message}} -> {:raise, message}
      result -> result
    end
  end

  defp prompt_ids(text, %Tokenizer{} = tokenizer) when is_binary(text),
    do: Tokenizer.encode(tokenizer, text)

  defp prompt_ids(text, nil) when is_binary(text),
    do: {:raise, "a text prompt needs a scheduler started with a :tokenizer"}

  defp prompt_ids(ids, _tokenizer), do: {:ok, ids}

  defp deliver(event, state) do
    case Map.fetch(state.requests, event.id) do
      {:ok, request} ->
        if event.ids != [] or event.text != "" do
          send(request.pid, {@tag, request.ref, {:tokens, event.ids, event.text}})
        end

        case event.finish_reason do
          nil ->
            state

          reason ->
            send(request.pid, {@tag, request.ref, {:done, reason, event.stats}})
            emit_request(reason, event.stats)
            forget(state, event.id)
        end

      # Cancelled while the step ran.
      :error ->
        state
    end
  end

  defp drop(state, nil), do: state

  defp drop(state, id) do
    Native.scheduler_cancel(state.resource, [id])
    forget(state, id)
  end

  defp forget(state, id) do
    case Map.pop(state.requests, id) do
      {nil, _} ->
        state

      {request, requests} ->
        Process.demonitor(request.monitor, [:flush])
        %{state | requests: requests, ids: Map.delete(state.ids, request.ref)}
    end
  end

  defp prefill_chunk(:auto) do
    if EMLXAxon.mlx_info().default_device == :gpu, do: 512, else: 128
  end

  defp prefill_chunk(tokens), do: tokens

  ## Telemetry (see EMLXAxon.Telemetry)

  defp emit_step(elapsed_us, events, occupancy) do
    duration = System.convert_time_unit(elapsed_us, :microsecond, :native)

    Telemetry.execute([:emlx_axon, :scheduler, :step], fn ->
      {%{
         duration: duration,
         running: occupancy.running,
         waiting: occupancy.waiting,
         slots: occupancy.slots,
         tokens: Enum.reduce(events, 0, &(length(&1.ids) + &2))
       }, %{}}
    end)
  end

  # The numbers are measurements; which engine paths ran is metadata.
  defp emit_request(reason, stats) do
    EMLXAxon.Notices.log_for(stats && Map.get(stats, :fallbacks))

    Telemetry.execute([:emlx_axon, :scheduler, :request], fn ->
      stats = stats || %{}
      paths = Result.paths(stats)
      {Map.drop(stats, Map.keys(paths)), Map.put(paths, :finish_reason, reason)}
    end)
  end
end
