defmodule EMLXAxon.TextGeneration.Serving.Scheduled do
  @moduledoc false
  # A serving built with :scheduler, without Nx: its executions only route
  # rows to a partition's EMLXAxon.Scheduler and return at once; each caller
  # then submits its own requests and waits for its own tokens in the
  # serving's client postprocessing (or, streaming, while it reads the
  # stream).
  #
  # Why the caller submits rather than the execution: the scheduler sends a
  # request's tokens to, and monitors, the process that submits it. An
  # execution runs in a task of the serving process that ends as soon as it
  # returns (its requests would be dropped with it), so it would need a
  # relay process living as long as its rows, one more hop per message, and
  # a way for callers to find and claim their rows. Nx.Serving runs the
  # client callbacks on the serving's node in the process that waits for the
  # result: the caller's own for a local call; for a caller on another node
  # (distributed batched_run), a process it spawns there, which sends the
  # final result, or each streamed item, back to the caller. That process
  # is the one the scheduler should message, and the one whose exit should
  # cancel the request: a remote caller's results travel home the way
  # Nx.Serving already sends them, as plain terms.

  #
  # A serving started with `scheduler: true` owns its schedulers: its
  # process starts them (one per partition, all on the serving's one
  # model) under a supervisor linked to it, so they restart when they fail
  # and stop with the serving. An execution's rows then carry a route
  # (`route/2`) to their partition's scheduler, resolved by the caller when
  # it submits: a restarted scheduler is a new process, found through the
  # supervisor. A serving run inline (`Nx.Serving.run/2`, no serving
  # process) starts a scheduler for the run and stops it after.

  alias EMLXAxon.{Error, Scheduler}
  alias EMLXAxon.TextGeneration.{Output, Scheduled}
  alias EMLXAxon.TextGeneration.Serving.Events

  @typedoc "Where an execution's rows are decoded."
  @type route ::
          {:shared, non_neg_integer()}
          | {:owned, pid(), non_neg_integer()}
          | :temporary

  # Room for a pid's external term with any node name.
  @route_width 512
  # How long a caller looks for a restarting scheduler.
  @locate_ms 1_000

  @doc """
  Starts `count` schedulers for `state` and `tokenizer` under a supervisor
  linked to the calling process; returns the supervisor.
  """
  @spec start_owned(EMLXAxon.Qwen3.Model.State.t(), EMLXAxon.Tokenizer.t(), map(), pos_integer()) ::
          {:ok, pid()} | {:error, term()}
  def start_owned(state, tokenizer, opts, count) do
    children =
      for index <- 0..(count - 1) do
        %{
          id: index,
          start:
            {Scheduler, :start_link, [scheduler_options(state, tokenizer, opts, slots(opts))]}
        }
      end

    Supervisor.start_link(children, strategy: :one_for_one, max_restarts: 10, max_seconds: 10)
  end

  # A serving's own scheduler decodes as many rows together as one of its
  # executions takes (`compile: [batch_size: n]`, the serving's batch
  # size), unless :scheduler_options sets :slots; nil: the scheduler's
  # default.
  defp slots(opts) do
    Keyword.get(opts.scheduler_options, :slots) || (opts.compile || [])[:batch_size]
  end

  defp scheduler_options(state, tokenizer, opts, slots) do
    options = [model: state, tokenizer: tokenizer, max_queue: opts.max_queue]
    options = Keyword.merge(options, opts.scheduler_options)
    if slots, do: Keyword.put(options, :slots, slots), else: options
  end

  @doc "The route of an execution of `partition` (see `t:route/0`)."
  @spec route(true | term(), nil | :inline | pid(), non_neg_integer()) :: route()
  def route(true, :inline, _partition), do: :temporary

  def route(true, supervisor, partition) when is_pid(supervisor),
    do: {:owned, supervisor, partition}

  def route(_shared, _owned, partition), do: {:shared, partition}

  @doc "`route` as a row of bytes and its size, so it travels in an execution's output."
  @spec encode_route(route()) :: {binary(), non_neg_integer()}
  def encode_route(route) do
    binary = :erlang.term_to_binary(route)
    {binary <> :binary.copy(<<0>>, @route_width - byte_size(binary)), byte_size(binary)}
  end

  @doc false
  def route_width, do: @route_width

  @doc "The route `encode_route/1` encoded."
  @spec decode_route(binary(), non_neg_integer()) :: route()
  def decode_route(row, size), do: row |> binary_part(0, size) |> :erlang.binary_to_term()

  @doc """
  Calls `fun` with the scheduler `route` leads to, among `schedulers` (the
  serving's `:scheduler` option) and with `state`, `tokenizer` and `opts`
  for a scheduler of its own. A temporary one is stopped when `fun`
  returns or raises, and when the calling process exits.
  """
  @spec with_scheduler(route(), map(), (Scheduler.server() -> result)) :: result
        when result: term()
  def with_scheduler({:shared, partition}, %{opts: opts}, fun),
    do: fun.(scheduler(opts.scheduler, partition))

  def with_scheduler({:owned, supervisor, partition}, _arg, fun) do
    deadline = System.monotonic_time(:millisecond) + @locate_ms
    fun.(locate!(supervisor, partition, deadline))
  end

  def with_scheduler(:temporary, arg, fun) do
    # One slot per input of the run, at most the configured slots.
    slots = min(arg.rows, slots(arg.opts) || 8)

    options = scheduler_options(arg.state, arg.tokenizer, arg.opts, max(slots, 1))
    {guardian, pid} = start_temporary(options)

    try do
      fun.(pid)
    after
      send(guardian, {self(), :stop})
    end
  end

  # A restarting scheduler is looked for again until `deadline`.
  defp locate!(supervisor, partition, deadline) do
    found =
      try do
        Enum.find_value(Supervisor.which_children(supervisor), fn
          {^partition, pid, _type, _modules} when is_pid(pid) -> pid
          _ -> nil
        end)
      catch
        :exit, _ -> :stopped
      end

    cond do
      is_pid(found) ->
        found

      found != :stopped and System.monotonic_time(:millisecond) < deadline ->
        Process.sleep(10)
        locate!(supervisor, partition, deadline)

      true ->
        raise Error,
          kind: :scheduler_down,
          message: "the serving's scheduler (partition #{partition}) is not running"
    end
  end

  # The scheduler is linked to a guardian process, not to the caller (a
  # scheduler that fails must fail the caller's request, not kill it): the
  # guardian stops it when the caller exits or is done with it.
  defp start_temporary(options) do
    caller = self()

    {guardian, monitor} =
      spawn_monitor(fn ->
        Process.flag(:trap_exit, true)
        watch = Process.monitor(caller)

        case Scheduler.start_link(options) do
          {:ok, pid} ->
            send(caller, {self(), {:ok, pid}})

            receive do
              {^caller, :stop} -> :ok
              {:DOWN, ^watch, :process, _, _} -> :ok
              {:EXIT, ^pid, _} -> :ok
            end

            # The scheduler stops (freeing its batch) as its parent exits.
            exit(:shutdown)

          {:error, reason} ->
            send(caller, {self(), {:error, reason}})
        end
      end)

    receive do
      {^guardian, {:ok, pid}} ->
        Process.demonitor(monitor, [:flush])
        {guardian, pid}

      {^guardian, {:error, %Error{} = error}} ->
        Process.demonitor(monitor, [:flush])
        raise error

      {^guardian, {:error, reason}} ->
        Process.demonitor(monitor, [:flush])

        raise Error,
          kind: :scheduler_down,
          message: "could not start a scheduler: #{inspect(reason)}"

      {:DOWN, ^monitor, :process, _, reason} ->
        raise Error,
          kind: :scheduler_down,
          message: "could not start a scheduler: #{inspect(reason)}"
    end
  end

  @doc "The scheduler of `partition`: partitions take the schedulers in turn."
  @spec scheduler(EMLXAxon.Scheduler.server() | [EMLXAxon.Scheduler.server()], non_neg_integer()) ::
          EMLXAxon.Scheduler.server()
  def scheduler([_ | _] = schedulers, partition),
    do: Enum.at(schedulers, rem(partition, length(schedulers)))

  def scheduler(scheduler, _partition), do: scheduler

  @doc """
  Runs `requests` through `scheduler` in the calling process and returns
  their outputs, as `run/4` with `scheduler:` does.
  """
  @spec run!(EMLXAxon.Scheduler.server(), EMLXAxon.Qwen3.Model.State.t(), [map()], map()) ::
          [map()]
  def run!(scheduler, state, requests, opts) do
    run!(scheduler, state, requests, opts, nil)
  end

  defp run!(scheduler, state, requests, opts, emit) do
    # The serving chose this scheduler: one gone since is down, not a bad
    # argument of the caller's.
    try do
      Scheduled.check!(scheduler, state, requests, opts)
    rescue
      error in ArgumentError ->
        if Process.alive?(Scheduled.whereis!(scheduler)),
          do: reraise(error, __STACKTRACE__),
          else: raise(Scheduled.down(scheduler, :noproc))
    end

    scheduler
    |> Scheduled.run!(requests, opts, emit)
    |> Enum.map(&Output.put_tool_calls(&1, opts.tools))
  end

  @doc """
  A lazy stream of `request`'s text as it arrives from `scheduler`, ending
  with `{:done, output}` when `opts.stream_done` (see
  `EMLXAxon.TextGeneration.Serving.Events`). Nothing is submitted until
  the stream is read; it must be read by one process, and halting it early
  cancels the request.
  """
  @spec stream(EMLXAxon.Scheduler.server(), EMLXAxon.Qwen3.Model.State.t(), map(), map()) ::
          Enumerable.t()
  def stream(scheduler, state, request, opts) do
    stream_with(& &1.(scheduler), state, request, opts)
  end

  @doc """
  `stream/4` through the scheduler `with_scheduler` gives (a function
  taking a function of the scheduler, as `with_scheduler/3` does), called
  when the stream is first read.
  """
  @spec stream_with(
          ((Scheduler.server() -> term()) -> term()),
          EMLXAxon.Qwen3.Model.State.t(),
          map(),
          map()
        ) :: Enumerable.t()
  def stream_with(with_scheduler, state, request, opts) do
    Stream.resource(
      fn -> start(with_scheduler, state, request, opts) end,
      fn
        {:running, _pid, ref} = acc ->
          receive do
            {^ref, {:text, text}} -> {[text], acc}
            {^ref, {:done, output}} -> {Events.items({:done, output}, opts.stream_done), :done}
            {^ref, {:raise, kind, reason, stack}} -> :erlang.raise(kind, reason, stack)
          end

        :done ->
          {:halt, :done}
      end,
      &stop/1
    )
  end

  # Scheduled.run! gathers a request's tokens by blocking until its end;
  # a linked process runs it and hands each piece over as it comes, so the
  # stream gives text as soon as it exists. The scheduler sees that process
  # as the caller: it exits with the reader (the link), and the scheduler
  # then drops the request.
  defp start(with_scheduler, state, request, opts) do
    owner = self()
    ref = make_ref()

    pid =
      spawn_link(fn ->
        emit = fn {0, text} -> send(owner, {ref, {:text, text}}) end

        result =
          try do
            [output] =
              with_scheduler.(fn scheduler -> run!(scheduler, state, [request], opts, emit) end)

            {:done, output}
          catch
            kind, reason -> {:raise, kind, reason, __STACKTRACE__}
          end

        send(owner, {ref, result})
      end)

    {:running, pid, ref}
  end

  defp stop({:running, pid, ref}) do
    Process.unlink(pid)
    Process.exit(pid, :kill)
    flush(ref)
  end

  defp stop(:done), do: :ok

  defp flush(ref) do
    receive do
      {^ref, _} -> flush(ref)
    after
      0 -> :ok
    end
  end
end
