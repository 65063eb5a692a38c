defmodule EMLXAxon.Scheduler do
  @moduledoc """
  Continuous batching for one loaded model: a process that owns a running
  batch of fixed slots and serves requests from any process.

  Requests join the running batch as soon as a slot is free: their prompt is
  run in bounded chunks between decode steps (so running rows keep their
  pace), and a finished row leaves at once, freeing its slot. Each request
  has its own options (`:max_new_tokens`, `:stop`, EOS, sampler,
  temperature, `:top_k`/`:top_p`/`:min_p` and `:seed`): a seeded request
  samples the same tokens whatever it is batched with, and a greedy request
  gives the ids of its solo run. Keys and values of earlier prompts are kept
  (bounded by `:prefix_cache_bytes`, least recently used first out) and
  reused by later prompts that start with the same tokens.

  A request may constrain its output with `:json_schema`, `:regex` or
  `:grammar` (see "Structured output" in `EMLXAxon.TextGeneration`; the
  scheduler needs a `:tokenizer` for them): its row's logits are masked to
  the tokens that can continue a valid output before its sampler runs,
  each row independently, so constrained and free requests share the
  batch (a free request gives the tokens it would without them). A
  constrained request ends with finish reason `:stop` once its output is
  complete. The masks are computed on the host while the device runs the
  step's forward pass; with a constrained row running, a step is sampled
  only once the previous step's tokens are read back (only the forward pass
  is queued ahead).

  The process drives the batch with short dirty NIF calls (one prompt chunk
  and up to `:steps_per_call` decode steps within `:step_budget_ms` each),
  so no dirty scheduler is held for
  a whole generation, and requests, cancellations and exits are handled
  between calls.

  ## Messages

  `submit/3` returns a reference; the caller then receives

    * `{EMLXAxon.Scheduler, ref, {:tokens, ids, text}}` - new tokens and
      their text (text that could start a stop string is held back)
    * `{EMLXAxon.Scheduler, ref, {:done, finish_reason, stats}}` - the
      last message: `finish_reason` is `:eos`, `:stop`, `:length`,
      `:max_len` or `:timeout`; `stats` holds `:prompt_tokens`,
      `:cached_tokens` (reused from the prefix cache), `:generated_tokens`,
      `:queue_ms`, `:prefill_ms`, `:time_to_first_token_ms`,
      `:decode_tokens_per_s` and `:constraint_ms` (host time spent on the
      request's constraint, 0 without one)
    * `{EMLXAxon.Scheduler, ref, {:error, %EMLXAxon.Error{}}}` - the
      request failed (also the last message)

  The caller is monitored: when it exits, its request is dropped at the next
  step, also while its prompt is being prefilled. `:timeout` (milliseconds)
  ends a request with finish reason `:timeout`. Past `:max_queue` waiting
  requests, `submit/3` returns `{:error, :overloaded}`.

  ## Telemetry

  When `:telemetry` is loaded: `[:emlx_axon, :scheduler, :request]` when a
  request ends (measurements: the `stats` above; metadata:
  `%{finish_reason: atom}`) and `[:emlx_axon, :scheduler, :step]` after
  every step (measurements: `:duration_ms`, `:running`, `:waiting`, `:slots`,
  `:tokens`).

  ## Example

      {:ok, server} = EMLXAxon.Scheduler.start_link(model: state, tokenizer: tokenizer)
      {:ok, %{text: text}} = EMLXAxon.Scheduler.generate(server, "Hello", max_new_tokens: 8)

  """

  use GenServer

  alias EMLXAxon.{Error, Native, Options, Tokenizer}
  alias EMLXAxon.Qwen3.Model.State

  @server_defaults [
    model: nil,
    tokenizer: nil,
    name: nil,
    slots: 8,
    capacity: 2048,
    prefill_chunk: :auto,
    steps_per_call: 64,
    step_budget_ms: 20,
    max_queue: 64,
    prefix_cache_bytes: 256 * 1024 * 1024,
    prefix_min_tokens: 16
  ]

  @type server :: GenServer.server()
  @type event ::
          {:tokens, [non_neg_integer()], String.t()}
          | {:done, atom(), map()}
          | {:error, Error.t()}

  @doc """
  Starts a scheduler for a loaded model.

  ## Options

    * `:model` - the `EMLXAxon.Qwen3.Model.State` (required)
    * `:tokenizer` - an `EMLXAxon.Tokenizer`, for text prompts, text
      output and stop strings (default `nil`)
    * `:slots` - rows decoded together (default 8)
    * `:capacity` - positions (prompt plus generated tokens) per row
      (default 2048); a request's `:max_len` is capped at it
    * `:prefill_chunk` - most prompt tokens run between two decode steps,
      also the most padded tokens of short prompts prefilled together
      (default `:auto`: 512 where MLX's default device is a GPU, whose
      prefill pass costs about the same for 128 tokens as for 512, and 128
      on the CPU, where it costs in proportion and running rows would wait)
    * `:steps_per_call` - most decode steps per NIF call (default 64)
    * `:step_budget_ms` - no further decode step starts in a NIF call once
      this many milliseconds have passed (at least one runs; default 20;
      `0`: always `:steps_per_call` steps). A call then takes about the same
      time whatever a step costs: many short GPU steps share one call's
      fixed cost, while long CPU steps still leave room every few
      milliseconds for new requests, cancellations and streaming
    * `:max_queue` - requests that may wait for a slot, past the `:slots`
      running ones (default 64)
    * `:prefix_cache_bytes` - budget of the prefix cache; `0` turns it off
      (default 256 MiB)
    * `:prefix_min_tokens` - shortest prompt prefix stored or reused
      (default 16)
    * `:name` - a name to register the process under
  """
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(opts) do
    opts = validate_server_opts!(opts)
    gen_opts = if opts.name, do: [name: opts.name], else: []
    GenServer.start_link(__MODULE__, opts, gen_opts)
  end

  @doc false
  def child_spec(opts) do
    %{id: Keyword.get(opts, :name, __MODULE__), start: {__MODULE__, :start_link, [opts]}}
  end

  @doc """
  Submits a request. `prompt` is a list of token ids, or a string when the
  scheduler has a tokenizer. `opts` are the generation options of
  `EMLXAxon.Qwen3.Generate.generate/3` (`:max_new_tokens`, `:max_len`,
  `:sampler`, `:temperature`, `:top_p`, `:top_k`, `:min_p`, `:seed`,
  `:stop`, `:eos_token_ids`, `:ignore_eos`), `:timeout` (milliseconds
  or `:infinity`, the default) and at most one of `:json_schema` (a map or
  JSON text), `:regex` and `:grammar` (a Lark grammar), which constrain
  the output.

  Returns `{:ok, ref}`; the tokens arrive as messages to the calling process
  (see the module documentation). `{:error, :overloaded}` when the queue is
  full; `{:error, %EMLXAxon.Error{}}` when the engine refuses the request.
  Invalid options, and a schema, regex or grammar the engine refuses, raise
  `ArgumentError` before the request is queued.
  """
  @spec submit(server(), [non_neg_integer()] | String.t(), keyword()) ::
          {:ok, reference()} | {:error, :overloaded | Error.t()}
  def submit(server, prompt, opts \\ []) do
    {timeout, opts} = Keyword.pop(opts, :timeout, :infinity)
    native = validate_request_opts!(opts, timeout)
    check_prompt!(prompt)

    case GenServer.call(server, {:submit, self(), prompt, native, timeout}, :infinity) do
      {:raise, message} -> raise ArgumentError, message
      reply -> reply
    end
  end

  defp check_prompt!(text) when is_binary(text) do
    unless String.valid?(text) do
      raise ArgumentError, "expected a text prompt to be valid UTF-8, got: #{inspect(text)}"
    end
  end

  defp check_prompt!([_ | _] = ids) do
    unless Enum.all?(ids, &(is_integer(&1) and &1 >= 0 and &1 < 4_294_967_296)) do
      raise ArgumentError, "expected a prompt of token ids, got: #{inspect(ids)}"
    end
  end

  defp check_prompt!(other) do
    raise ArgumentError,
          "expected a prompt (a non-empty list of token ids or a string), got: #{inspect(other)}"
  end

  @doc "Cancels a request of the calling process (or any, given its ref); its slot is freed."
  @spec cancel(server(), reference()) :: :ok
  def cancel(server, ref) when is_reference(ref) do
    GenServer.call(server, {:cancel, ref}, :infinity)
  end

  @doc """
  Submits a request and waits for its end. Returns `{:ok, %{ids: ids,
  text: text, finish_reason: reason, stats: stats}}`.
  """
  @spec generate(server(), [non_neg_integer()] | String.t(), keyword()) ::
          {:ok, map()} | {:error, :overloaded | Error.t()}
  def generate(server, prompt, opts \\ []) do
    with {:ok, ref} <- submit(server, prompt, opts) do
      collect(ref, [], [])
    end
  end

  defp collect(ref, ids, text) do
    receive do
      {__MODULE__, ^ref, {:tokens, new_ids, new_text}} ->
        collect(ref, [new_ids | ids], [text, new_text])

      {__MODULE__, ^ref, {:done, reason, stats}} ->
        {:ok,
         %{
           ids: ids |> Enum.reverse() |> Enum.concat(),
           text: IO.iodata_to_binary(text),
           finish_reason: reason,
           stats: stats
         }}

      {__MODULE__, ^ref, {:error, error}} ->
        {:error, error}
    end
  end

  @doc """
  Submits a request and returns a lazy stream of `{ids, text}` chunks.
  Halting the stream early cancels the request. Raises on errors.
  """
  @spec stream(server(), [non_neg_integer()] | String.t(), keyword()) :: Enumerable.t()
  def stream(server, prompt, opts \\ []) do
    Stream.resource(
      fn ->
        case submit(server, prompt, opts) do
          {:ok, ref} -> {:running, ref}
          {:error, :overloaded} -> raise Error, kind: :overloaded, message: "the queue is full"
          {:error, error} -> raise error
        end
      end,
      fn
        {:done, ref} ->
          {:halt, {:done, ref}}

        {:running, ref} ->
          receive do
            {__MODULE__, ^ref, {:tokens, ids, text}} -> {[{ids, text}], {:running, ref}}
            {__MODULE__, ^ref, {:done, _reason, _stats}} -> {:halt, {:done, ref}}
            {__MODULE__, ^ref, {:error, error}} -> raise error
          end
      end,
      fn
        {:running, ref} -> cancel(server, ref)
        {:done, _ref} -> :ok
      end
    )
  end

  @doc """
  Slot use: `%{running: n, waiting: n, slots: n, prefix_entries: n,
  prefix_bytes: n}`.
  """
  @spec occupancy(server()) :: map()
  def occupancy(server), do: GenServer.call(server, :occupancy, :infinity)

  @doc false
  # The model and tokenizer the scheduler serves, for callers that encode
  # their own prompts and must check they target the same model.
  @spec model(server()) :: %{model: State.t(), tokenizer: Tokenizer.t() | nil}
  def model(server), do: GenServer.call(server, :model, :infinity)

  @doc "Drops every stored prompt prefix."
  @spec clear_prefix_cache(server()) :: :ok
  def clear_prefix_cache(server), do: GenServer.call(server, :clear_prefix_cache, :infinity)

  @doc "Stops the scheduler; running requests end with an error."
  @spec stop(server()) :: :ok
  def stop(server), do: GenServer.stop(server)

  ## Options

  defp validate_server_opts!(opts) do
    unless Keyword.keyword?(opts) do
      raise ArgumentError,
            "expected EMLXAxon.Scheduler.start_link/1 options to be a keyword list, got: #{inspect(opts)}"
    end

    case Keyword.keys(opts) -- Keyword.keys(@server_defaults) do
      [] ->
        :ok

      unknown ->
        raise ArgumentError,
              "unknown options #{inspect(unknown)} for EMLXAxon.Scheduler.start_link/1, valid options are: " <>
                Enum.map_join(Keyword.keys(@server_defaults), ", ", &inspect/1)
    end

    opts = Map.new(Keyword.merge(@server_defaults, opts))

    unless match?(%State{}, opts.model) do
      raise ArgumentError,
            "expected :model to be an EMLXAxon.Qwen3.Model.State, got: #{inspect(opts.model)}"
    end

    unless is_nil(opts.tokenizer) or match?(%Tokenizer{}, opts.tokenizer) do
      raise ArgumentError,
            "expected :tokenizer to be an EMLXAxon.Tokenizer or nil, got: #{inspect(opts.tokenizer)}"
    end

    for key <- [:slots, :capacity, :steps_per_call] do
      pos_integer!(key, Map.fetch!(opts, key))
    end

    unless opts.prefill_chunk == :auto, do: pos_integer!(:prefill_chunk, opts.prefill_chunk)

    for key <- [:max_queue, :prefix_cache_bytes, :prefix_min_tokens, :step_budget_ms] do
      value = Map.fetch!(opts, key)

      unless is_integer(value) and value >= 0 do
        raise ArgumentError,
              "expected #{inspect(key)} to be a non-negative integer, got: #{inspect(value)}"
      end
    end

    opts
  end

  defp prefill_chunk(:auto) do
    if EMLXAxon.mlx_info().default_device == :gpu, do: 512, else: 128
  end

  defp prefill_chunk(tokens), do: tokens

  defp pos_integer!(key, value) do
    unless is_integer(value) and value > 0 do
      raise ArgumentError,
            "expected #{inspect(key)} to be a positive integer, got: #{inspect(value)}"
    end
  end

  defp validate_request_opts!(opts, timeout) do
    unless timeout == :infinity or (is_integer(timeout) and timeout >= 0) do
      raise ArgumentError,
            "expected :timeout to be a non-negative integer or :infinity, got: #{inspect(timeout)}"
    end

    where = "EMLXAxon.Scheduler.submit/3"
    defaults = Options.generation_defaults() ++ Options.constraint_defaults()
    opts = Options.validate!(opts, defaults, where)

    opts
    |> Map.put(:profile_timing, false)
    |> Options.native()
    |> Map.drop([:profile_timing, :row_seeds])
    |> Map.put(:constraint, Options.constraint!(opts, where))
  end

  ## Server

  @impl true
  def init(opts) do
    tokenizer_ref = if opts.tokenizer, do: opts.tokenizer.ref

    native_opts = %{
      slots: opts.slots,
      capacity: opts.capacity,
      prefill_chunk: prefill_chunk(opts.prefill_chunk),
      prefix_cache_bytes: opts.prefix_cache_bytes,
      prefix_min_tokens: opts.prefix_min_tokens
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
           steps: opts.steps_per_call,
           budget_us: opts.step_budget_ms * 1000,
           # native id -> request; ref -> native id
           requests: %{},
           ids: %{},
           stepping: false
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

      request = %{
        ref: ref,
        pid: pid,
        monitor: Process.monitor(pid),
        deadline: deadline(timeout)
      }

      state = %{
        state
        | requests: Map.put(state.requests, id, request),
          ids: Map.put(state.ids, ref, id)
      }

      {:reply, {:ok, ref}, schedule_step(state)}
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
  def handle_info(:step, state) do
    state = %{state | stepping: false}
    state = expire(state)

    if map_size(state.requests) == 0 do
      {:noreply, state}
    else
      started = System.monotonic_time()

      case Error.wrap(Native.scheduler_step(state.resource, state.steps, state.budget_us)) do
        {:ok, {events, occupancy}} ->
          state = Enum.reduce(events, state, &deliver/2)
          emit_step(started, events, occupancy)
          {:noreply, schedule_step(state)}

        {:error, error} ->
          # A failed step leaves the batch in an unknown state: every
          # request ends with the error.
          for {id, request} <- state.requests do
            send(request.pid, {__MODULE__, request.ref, {:error, error}})
            Native.scheduler_cancel(state.resource, [id])
          end

          {:noreply, %{state | requests: %{}, ids: %{}}}
      end
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
      send(request.pid, {__MODULE__, request.ref, {:error, error}})
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

  defp deadline(:infinity), do: nil

  defp deadline(ms),
    do: System.monotonic_time() + System.convert_time_unit(ms, :millisecond, :native)

  defp schedule_step(%{stepping: true} = state), do: state

  defp schedule_step(state) do
    if map_size(state.requests) > 0 do
      send(self(), :step)
      %{state | stepping: true}
    else
      state
    end
  end

  defp deliver(event, state) do
    case Map.fetch(state.requests, event.id) do
      {:ok, request} ->
        if event.ids != [] or event.text != "" do
          send(request.pid, {__MODULE__, request.ref, {:tokens, event.ids, event.text}})
        end

        case event.finish_reason do
          nil ->
            state

          reason ->
            send(request.pid, {__MODULE__, request.ref, {:done, reason, event.stats}})
            emit_request(reason, event.stats)
            forget(state, event.id)
        end

      # Cancelled while the step ran.
      :error ->
        state
    end
  end

  defp expire(state) do
    now = System.monotonic_time()

    expired =
      for {id, %{deadline: deadline}} <- state.requests, deadline != nil, now >= deadline, do: id

    Enum.reduce(expired, state, fn id, state ->
      request = state.requests[id]
      send(request.pid, {__MODULE__, request.ref, {:done, :timeout, %{}}})
      drop(state, id)
    end)
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

  ## Telemetry (optional dependency)

  defp emit_step(started, events, occupancy) do
    duration = System.monotonic_time() - started

    execute([:emlx_axon, :scheduler, :step], fn ->
      {%{
         duration_ms: System.convert_time_unit(duration, :native, :microsecond) / 1000,
         running: occupancy.running,
         waiting: occupancy.waiting,
         slots: occupancy.slots,
         tokens: Enum.reduce(events, 0, &(length(&1.ids) + &2))
       }, %{}}
    end)
  end

  defp emit_request(reason, stats) do
    execute([:emlx_axon, :scheduler, :request], fn -> {stats || %{}, %{finish_reason: reason}} end)
  end

  defp execute(event, fun) do
    if Code.ensure_loaded?(:telemetry) and function_exported?(:telemetry, :execute, 3) do
      {measurements, metadata} = fun.()
      apply(:telemetry, :execute, [event, measurements, metadata])
    end

    :ok
  end
end
